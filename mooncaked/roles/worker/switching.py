"""A prefill or decode instance that may switch between the two at run time (`worker.switchable: true`).

1. `start()`: load the model once (one `Worker`: weights, KV pages, compute thread, store clients), activate the
   starting role (`--role prefill|decode`), then serve one RPC endpoint whose PREFILL, RESERVE, UNRESERVE,
   DECODE and LOAD calls go to the active role, and SWITCH.
2. SWITCH to the other role: publish `draining` (conductors stop placing here), wait `cluster.etcd.drain_notice_s`
   for every conductor to see it, then refuse new work (PREFILL and RESERVE), wait until in-flight work has finished
   (up to the request's drain deadline; what is left then is cancelled), deactivate the old role, activate the new one
   on the same worker (its weights stay loaded, its KV pages are all free again and serve the new role), and publish the
   record as `ready` under the new role. Switches are logged, counted in metrics and in LOAD/INFO replies.
3. `stop()`: stop the endpoints, deactivate the active role, stop the worker.

Owns the worker, both role objects (one active at a time), the RPC and metrics endpoints and the switch lock.
The membership is borrowed (its owner, `MemberRole`, starts and stops it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from mooncaked.cluster.membership import Membership, StaticMembership
from mooncaked.config import Config, InstanceConfig
from mooncaked.roles.base import RoleEndpoint
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.messages import (DECODE, LOAD, PREFILL, RESERVE, UNRESERVE, DecodeItem, DecodeRequest,
                                             LoadReply, LoadRequest, PrefillReply, PrefillRequest, ReserveReply,
                                             ReserveRequest, UnreserveReply, UnreserveRequest)
from mooncaked.roles.worker.prefill.role import PrefillRole
from mooncaked.roles.worker.profiler import profile
from mooncaked.roles.worker.switch_messages import SWITCH, SwitchReply, SwitchRequest
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext, InvalidArgument, Unavailable
from mooncaked.runtime.metrics import Metrics
from mooncaked.runtime.metrics_http import MetricsEndpoint

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02  # how often a drain re-checks for queued or reserved work that holds no RPC call open


class SwitchableWorkerRole:
    """See the module docstring."""

    def __init__(self, config: Config, instance: InstanceConfig, membership: Membership | None = None) -> None:
        self.config = config
        self.instance = instance
        self.name = f"{instance.role} {instance.name} (switchable)"
        self.membership = membership or StaticMembership(config, instance)
        self.worker = Worker(config, instance, self.membership)
        self.metrics = Metrics()
        self.prefill = PrefillRole(config, instance, worker=self.worker)
        self.decode = DecodeRole(config, instance, worker=self.worker)
        self.prefill.metrics = self.decode.metrics = self.metrics  # one registry, whichever role is active
        self.role: str = instance.role
        self.is_accepting = True
        self.num_switches = 0
        self.last_switch_at = 0.0
        self._num_calls = 0  # PREFILL and DECODE calls in progress (DECODE holds its call while it streams)
        self._switch_lock = asyncio.Lock()
        self.endpoint = RoleEndpoint(config, instance, extra_info=self._info)
        self.endpoint.add_method(PREFILL, self._prefill)
        self.endpoint.add_method(RESERVE, self._reserve)
        self.endpoint.add_method(UNRESERVE, self._unreserve)
        self.endpoint.add_method(DECODE, self._decode)
        self.endpoint.add_method(LOAD, self._load, is_eager=True)
        self.endpoint.add_method(SWITCH, self._switch)
        self.metrics_endpoint = MetricsEndpoint(instance.host, instance.metrics_port, self.metrics,
                                                self._refresh_metrics)

    @property
    def active(self) -> PrefillRole | DecodeRole:
        return self.prefill if self.role == "prefill" else self.decode

    async def start(self) -> None:
        await self.worker.start()
        await profile(self.worker, with_decode=True)  # either role may come: profile both
        self.active.activate()
        await self.endpoint.start()
        await self.metrics_endpoint.start()

    async def stop(self) -> None:
        await self.metrics_endpoint.stop()
        await self.endpoint.stop()
        await self.active.deactivate()
        await self.decode.reservations.close()
        await self.worker.stop()

    def _refresh_metrics(self) -> None:
        self.active._refresh_metrics()

    def _info(self) -> dict[str, str]:
        return {**self.active._info(), "role": self.role, "num_switches": str(self.num_switches),
                "is_accepting": str(self.is_accepting)}

    # ---- calls, routed to the active role ------------------------------------------------------------------
    def _refuse(self, wanted: str) -> str:
        if self.role != wanted:
            return f"{self.instance.name} serves {self.role} now, not {wanted}"
        return "" if self.is_accepting else f"{self.instance.name} is switching roles"

    async def _prefill(self, request: PrefillRequest, ctx: CallContext) -> PrefillReply:
        refusal = self._refuse("prefill")
        if refusal:
            raise Unavailable(refusal + "; place the request elsewhere")
        self._num_calls += 1
        try:
            return await self.prefill._prefill(request, ctx)
        finally:
            self._num_calls -= 1

    async def _reserve(self, request: ReserveRequest, ctx: CallContext) -> ReserveReply:
        refusal = self._refuse("decode")
        if refusal:
            return ReserveReply(is_accepted=False, reason=f"switching: {refusal}")
        return await self.decode._reserve(request, ctx)

    async def _unreserve(self, request: UnreserveRequest, ctx: CallContext) -> UnreserveReply:
        return await self.decode._unreserve(request, ctx)

    async def _decode(self, request: DecodeRequest, ctx: CallContext) -> AsyncIterator[DecodeItem]:
        if self.role != "decode":
            raise Unavailable(self._refuse("decode"))
        self._num_calls += 1
        try:
            async for item in self.decode._decode(request, ctx):  # a reservation made before draining: serve it
                yield item
        finally:
            self._num_calls -= 1

    async def _load(self, request: LoadRequest, ctx: CallContext) -> LoadReply:
        return await self.active._load(request, ctx)

    # ---- switching ------------------------------------------------------------------------------------------
    async def _switch(self, request: SwitchRequest, ctx: CallContext) -> SwitchReply:
        if request.role not in ("prefill", "decode"):
            raise InvalidArgument(f"cannot switch to role {request.role!r}: use prefill or decode")
        if self._switch_lock.locked():
            return SwitchReply(self.role, False, "a switch is already in progress", num_switches=self.num_switches)
        async with self._switch_lock:
            if request.role == self.role:
                return SwitchReply(self.role, False, f"already {self.role}", num_switches=self.num_switches)
            return await self.switch_to(request.role, request.drain_timeout_s, request.reason)

    async def switch_to(self, role: str, drain_timeout_s: float, reason: str = "") -> SwitchReply:
        """Drain, switch in place, re-register; see the module docstring."""
        old, started = self.role, time.monotonic()
        logger.info("switching %s -> %s (%s): draining up to %.1f s", old, role, reason or "asked", drain_timeout_s)
        await self.membership.set_state("draining")
        await asyncio.sleep(self.config.cluster.etcd.drain_notice_s)  # conductors see `draining` before refusals
        self.is_accepting = False
        try:
            num_left = await self._drain(started + drain_timeout_s)
            await self.active.deactivate()
            if num_left:
                logger.warning("switch %s -> %s: %d requests still running at the drain deadline were cancelled",
                               old, role, num_left)
            pages = self.worker.pages
            if pages is not None and pages.num_free != pages.num_pages:
                logger.warning("switch %s -> %s: %d KV pages still held by cancelled requests (freed as they end)",
                               old, role, pages.num_pages - pages.num_free)
            self.role = role
            self.active.activate()
        finally:
            self.is_accepting = True
            await self.membership.set_state("ready", role=self.role)
        self.num_switches += 1
        self.last_switch_at = time.monotonic()
        drain_s = self.last_switch_at - started
        self.metrics.role_switches_total.labels(from_role=old, to_role=role).inc()
        logger.info("switched %s -> %s in %.2f s (weights and %d KV pages kept)", old, role, drain_s,
                    self.worker.num_pages)
        return SwitchReply(role, True, drain_s=drain_s, num_cancelled=num_left, num_switches=self.num_switches)

    async def _drain(self, deadline: float) -> int:
        """Wait until the active role holds no work (or the deadline); the number of calls still open then."""
        while time.monotonic() < deadline:
            if self._num_calls == 0 and self.active.is_idle:
                return 0
            await asyncio.sleep(min(DRAIN_POLL_S, max(deadline - time.monotonic(), 0.0)))
        return self._num_calls + (0 if self.active.is_idle else 1)
