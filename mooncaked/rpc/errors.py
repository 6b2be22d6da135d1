"""RPC errors: each travels as {code, message} and is raised on the caller as the subclass of its code."""

from __future__ import annotations


class RpcError(Exception):
    """Base of every RPC failure; `code` is the wire string, `message` the human-readable reason."""

    code = "unknown"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class DeadlineExceeded(RpcError):
    code = "deadline_exceeded"


class Cancelled(RpcError):
    code = "cancelled"


class Unavailable(RpcError):
    """The peer cannot be reached, went away, or is stopping; retrying later may succeed."""

    code = "unavailable"


class InvalidArgument(RpcError):
    code = "invalid_argument"


class NotFound(RpcError):
    code = "not_found"


class ResourceExhausted(RpcError):
    code = "resource_exhausted"


class Unauthenticated(RpcError):
    code = "unauthenticated"


class Internal(RpcError):
    code = "internal"


ERRORS_BY_CODE: dict[str, type[RpcError]] = {
    cls.code: cls
    for cls in (DeadlineExceeded, Cancelled, Unavailable, InvalidArgument, NotFound, ResourceExhausted,
                Unauthenticated, Internal)
}


def error_from_wire(code: object, message: object) -> RpcError:
    """The exception for a received {code, message}; an unknown code becomes Internal naming it."""
    cls = ERRORS_BY_CODE.get(code) if isinstance(code, str) else None
    text = message if isinstance(message, str) else repr(message)
    if cls is None:
        return Internal(f"peer sent unknown error code {code!r}: {text}")
    return cls(text)
