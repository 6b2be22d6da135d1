"""Per-tenant rate limits and concurrency caps: one tenant's excess never delays another's requests.

1. `try_admit(tenant, now)` takes a token from the tenant's bucket (`requests_per_s`, holding at most
   max(1, requests_per_s) tokens) and a slot of its `max_concurrent`; it answers None (admitted) or the seconds
   after which a retry may succeed (the 429's Retry-After).
2. `release(tenant)` gives the slot back when the request ends, however it ends.
3. `update(tenants)` follows a reload: buckets and counts of tenants that remain are kept, others dropped.
Pure over `now`: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from mooncaked.api.tenants import Tenant


@dataclass
class _State:
    tokens: float
    updated: float
    num_active: int = 0


class TenantLimits:
    """Owns every tenant's bucket and in-flight count (owned by the HTTP app)."""

    def __init__(self, tenants: Mapping[str, Tenant]) -> None:
        self.tenants = dict(tenants)
        self._states: dict[str, _State] = {}

    def update(self, tenants: Mapping[str, Tenant]) -> None:
        self.tenants = dict(tenants)
        self._states = {tid: state for tid, state in self._states.items() if tid in tenants}

    def try_admit(self, tenant_id: str, now: float) -> float | None:
        tenant = self.tenants.get(tenant_id)
        if tenant is None:
            return None
        state = self._states.setdefault(tenant_id, _State(_burst(tenant), now))
        if tenant.max_concurrent is not None and state.num_active >= tenant.max_concurrent:
            return 1.0
        if tenant.requests_per_s is not None:
            state.tokens = min(_burst(tenant), state.tokens + (now - state.updated) * tenant.requests_per_s)
            state.updated = now
            if state.tokens < 1.0:
                return (1.0 - state.tokens) / tenant.requests_per_s
            state.tokens -= 1.0
        state.num_active += 1
        return None

    def release(self, tenant_id: str) -> None:
        state = self._states.get(tenant_id)
        if state is not None and state.num_active > 0:
            state.num_active -= 1


def _burst(tenant: Tenant) -> float:
    return max(1.0, tenant.requests_per_s) if tenant.requests_per_s is not None else math.inf

