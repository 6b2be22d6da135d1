"""The HTTP layer's door for tenants: who is calling, and whether their limits let the request in.

1. `identify(authorization)` maps the Bearer key to its tenant: 401 for a missing or unknown key when tenants
   (or API keys) are configured; None (anonymous) when none are.
2. `admit(tenant)` is a context manager around one generation request: a tenant over its `requests_per_s` or
   `max_concurrent` gets 429 (`rate_limit_exceeded`, with Retry-After), counted by `on_rejected`; the slot is
   given back when the request ends.
3. `reload(directory)` swaps the tenants in use between requests (SIGHUP); requests already admitted keep their
   slots, and a tenant that stays keeps its bucket.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from mooncaked.api.errors import ApiError, unauthorized
from mooncaked.api.limits import TenantLimits
from mooncaked.api.tenants import Tenant, TenantDirectory

RejectionHook = Callable[[str, str], None]  # (tenant id, reason)


class TenantGate:
    """Owns the tenant directory in use and the per-tenant limits (owned by the conductor's HTTP app)."""

    def __init__(self, directory: TenantDirectory, on_rejected: RejectionHook | None = None) -> None:
        self.directory = directory
        self.limits = TenantLimits(directory.tenants)
        self.on_rejected = on_rejected

    def reload(self, directory: TenantDirectory) -> None:
        self.directory = directory
        self.limits.update(directory.tenants)

    def identify(self, authorization: str) -> Tenant | None:
        if self.directory.is_open:
            return None
        scheme, _, token = authorization.partition(" ")
        tenant = self.directory.identify(token.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise unauthorized()
        return tenant

    @contextlib.contextmanager
    def admit(self, tenant: Tenant | None) -> Iterator[None]:
        if tenant is None:
            yield
            return
        retry_after_s = self.limits.try_admit(tenant.id, time.monotonic())
        if retry_after_s is not None:
            if self.on_rejected is not None:
                self.on_rejected(tenant.id, "rate_limit")
            raise ApiError(429, f"Tenant {tenant.id} is over its limit ({_limits(tenant)}); retry after "
                           f"{retry_after_s:.1f} s.", code="rate_limit_exceeded", retry_after_s=retry_after_s)
        try:
            yield
        finally:
            self.limits.release(tenant.id)


def _limits(tenant: Tenant) -> str:
    parts = []
    if tenant.requests_per_s is not None:
        parts.append(f"{tenant.requests_per_s:g} requests per second")
    if tenant.max_concurrent is not None:
        parts.append(f"{tenant.max_concurrent} concurrent requests")
    return ", ".join(parts)
