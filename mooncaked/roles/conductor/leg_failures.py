"""How a leg's failure reaches its request: it moves to other instances, it is refused, or the client gets an error.

1. `rejection_error()`: the scheduler's refusal (a `Rejection`) as the client's error: a 503 when no instance of a
   needed role is up, else a 429 with Retry-After and the reason in words.
2. `leg_failure()`: an RPC error of a RESERVE, PREFILL or DECODE leg (leg.py) as `LegFailed` when another instance
   may succeed (`cause` is one of MIGRATION_CAUSES; the request migrates: request_run.py), `Rejected` for a
   refusal, or else the `ApiError` the client gets. An instance that missed its deadline, is unreachable or is
   stopping is reported down (`report_down`: the cluster view's `health.report_failure`).
"""

from __future__ import annotations

from collections.abc import Callable

from mooncaked.api.errors import ApiError, deadline_exceeded, internal_error, overloaded, unavailable
from mooncaked.roles.worker.messages import REASON_KV_LOAD_FAILED
from mooncaked.rpc import Cancelled, DeadlineExceeded, ResourceExhausted, RpcError, Unavailable
from mooncaked.sched.decode_admission import REASON_PAGES_NOT_FREED
from mooncaked.sched.types import Placement, REASON_DECODE_REFUSED, Rejection

MIGRATION_CAUSES = frozenset({f"{leg}_{kind}" for leg in ("reserve", "prefill", "decode")
                              for kind in ("lost", "deadline")} | {"decode_pages", "prefill_source"})


class LegFailed(Exception):
    """A leg failed in a way another instance may not: `cause` is one of MIGRATION_CAUSES."""

    def __init__(self, cause: str, instance: str, error: ApiError) -> None:
        super().__init__(f"{cause} on {instance}: {error.message}")
        self.cause = cause
        self.instance = instance
        self.error = error


class Rejected(Exception):
    """The scheduler or an instance refused the request: `error` is the 429 or 503 and `reason` why."""

    def __init__(self, reason: str, error: ApiError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


def rejection_error(rejection: Rejection, retry_after_s: float) -> ApiError:
    if rejection.reason in ("no_prefill_instance", "no_decode_instance"):
        role = "prefill" if rejection.reason == "no_prefill_instance" else "decode"
        return unavailable(f"No {role} instance is up; retry shortly.")
    text = _REJECTION_TEXT.get(rejection.reason, rejection.reason)
    reason = text.format(ttft=rejection.predicted_ttft_s, tbt=rejection.predicted_tbt_s)
    return overloaded(reason, retry_after_s)


def leg_failure(leg: str, instance: str, exc: RpcError, *, leg_id: str, placement: Placement | None,
                retry_after_s: float, report_down: Callable[[str, str], None]) -> Exception:
    """LegFailed when another instance may succeed, Rejected for a refusal, else the ApiError. `leg`: "reserve",
    "prefill" or "decode"; `placement`: the leg's (the prefix fetch's source store is in it)."""
    if isinstance(exc, DeadlineExceeded):
        report_down(instance, str(exc))
        error = deadline_exceeded(f"The {leg} leg on {instance} missed its deadline; retry later.")
        return LegFailed(f"{leg}_deadline", instance, error)
    if isinstance(exc, Unavailable) and exc.message.startswith(REASON_KV_LOAD_FAILED):
        # a store did not deliver the KV (stopped, partitioned); the instance answered, so it is not marked
        # down. The other host's store of a prefix fetch: the next placement leaves it out (another copy of
        # the prefix, or the prompt computed)
        assert placement is not None, "place() first"
        source = placement.fetch_from_store
        if leg == "prefill" and source:
            return LegFailed("prefill_source", source, unavailable(
                f"The prefix's source store {source} did not deliver it to {instance}; retry shortly."))
        return LegFailed(f"{leg}_lost", instance,
                         unavailable(f"The {leg} instance {instance} could not load the KV; retry shortly."))
    if isinstance(exc, (Unavailable, Cancelled)):  # unreachable, or stopping and cancelling its calls
        report_down(instance, str(exc))
        return LegFailed(f"{leg}_lost", instance,
                         unavailable(f"The {leg} instance {instance} is unreachable; retry shortly."))
    if isinstance(exc, ResourceExhausted) and exc.message.startswith(REASON_PAGES_NOT_FREED):
        # the decode instance's memory forecast was wrong: another decode instance may have the pages
        return LegFailed(f"{leg}_pages", instance, overloaded(f"{instance} had no KV pages free in time",
                                                              retry_after_s))
    if isinstance(exc, ResourceExhausted) and exc.message.startswith(REASON_DECODE_REFUSED):
        return Rejected(REASON_DECODE_REFUSED, rejection_error(Rejection(leg_id, REASON_DECODE_REFUSED),
                                                               retry_after_s))
    if isinstance(exc, ResourceExhausted):
        return overloaded(f"{instance} is out of capacity: {exc.message}", retry_after_s)
    return internal_error(f"The {leg} leg on {instance} failed: {exc.message}")


_REJECTION_TEXT = {
    "ttft_slo": "predicted time to first token {ttft:.2f} s is over its SLO",
    "tbt_slo": "predicted time between tokens {tbt:.3f} s is over its SLO",
    "decode_full": "every decode instance is full",
    REASON_DECODE_REFUSED: "the decode instance refused the request",
}
