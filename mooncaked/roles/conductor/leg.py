"""One attempt at serving a request: place it, RESERVE, PREFILL, DECODE, and give back what it held.

1. `LegWork` is what the attempt serves: the prompt (a migrated request's prompt plus the tokens it already
   streamed), its block keys, the tokens left and the seed state; `leg_id` (`attempt_id`: unique per attempt)
   names it on the instances.
2. `place()` runs Algorithm 1 (a Rejection becomes a 429 or 503), leaving out instances this request saw fail.
3. `reserve()`, `prefill()`, `open_decode()` and `next_item()` drive the legs, each with its deadline; a wait for
   the next token also ends as soon as the view reports the decode instance down (`view.health.watch_down`,
   view/worker_health.py: a stopped process keeps its connection open, so only the polls notice it) once it has
   waited a LOAD poll's deadline (`conductor.load_poll_timeout_s`), as `decode_lost`. A leg that fails in a way
   another instance can fix (unreachable, stopping, past its deadline) raises `LegFailed` with the cause; a
   refusal raises `Rejected`; every other failure raises the `ApiError` the client gets (leg_failures.py sorts
   them).
4. `settle()` closes the DECODE stream (cancelling it remotely), runs an owed DECODE to its end, and UNRESERVEs a
   reservation DECODE never claimed; then the view forgets the leg.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mooncaked.api.errors import deadline_exceeded, internal_error, overloaded, unavailable
from mooncaked.config import Config
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.leg_failures import LegFailed, Rejected, leg_failure, rejection_error
from mooncaked.roles.conductor.view.cluster import ClusterView
from mooncaked.roles.worker.messages import (DECODE, DecodeItem, DecodeRequest, PREFILL, PrefillReply, PrefillRequest,
                                             RESERVE, ReserveReply, ReserveRequest, SamplingSpec, StoreTenant,
                                             TokenSample, UNRESERVE, UnreserveRequest)
from mooncaked.rpc import RpcClient, RpcError
from mooncaked.runtime.aio import aclose
from mooncaked.sched.decode_admission import rejection_reason
from mooncaked.sched.types import Placement, Rejection, RequestInfo

logger = logging.getLogger(__name__)

UNRESERVE_TIMEOUT_S = 2.0  # cleanup only: an unclaimed reservation also ends with its lease


def attempt_id(request_id: str, num_migrations: int) -> str:
    """The id an attempt goes by on the instances (reservation, KV pages, in-flight work): unique per attempt,
    since the request id may be the client's own `X-Request-Id`, which other live requests may share. It starts
    with the request id so that the instances' logs still name the client's."""
    return f"{request_id}~{num_migrations}.{secrets.token_hex(8)}"


@dataclass(frozen=True)
class LegWork:
    leg_id: str
    token_ids: tuple[int, ...]
    block_keys: tuple[bytes, ...]
    sampling: SamplingSpec  # max_tokens: the tokens left; num_sampled: those already streamed
    arrival_time: float
    max_tokens: int  # the request's own max_tokens (the output-length predictor's key)
    client_id: str
    key_isolation: bytes = b""  # who may share its KV (kv/keys.py)
    tenant: StoreTenant | None = None  # who owns its new blocks in the stores, and that tenant's shares


class Leg:
    """Owns one attempt's placement, reservation state and DECODE stream."""

    def __init__(self, config: Config, view: ClusterView, peers: PeerClients, work: LegWork) -> None:
        self.config = config
        self.view = view
        self.peers = peers
        self.work = work
        self.placement: Placement | None = None
        self.decode_stream: AsyncIterator[DecodeItem] | None = None
        self.is_decode_owed = False  # the first token ended the request: DECODE still runs, to commit and free
        self.may_hold_reservation = False  # RESERVE was sent and not refused: the decode instance may hold one
        self.is_decode_sent = False  # DECODE went out: the decode instance frees the reservation itself
        self.num_decode_items = 0
        self.is_settled = False
        self.predicted_output_tokens = 0  # the output-length predictor's forecast at placement (0: none)

    # ---- placement ----------------------------------------------------------------------------------------
    def place(self, excluded: frozenset[str]) -> Placement:
        work = self.work
        max_tokens = work.sampling.max_tokens
        predicted_tokens = self.view.forecast.tokens_for(work.client_id, max_tokens, len(work.token_ids))
        info = RequestInfo(work.leg_id, len(work.token_ids), work.block_keys, work.arrival_time, max_tokens,
                           predicted_tokens, num_sequences=work.sampling.num_sequences)
        now = time.monotonic()
        result = self.view.place(info, now, excluded=excluded)
        if isinstance(result, Rejection):
            raise Rejected(result.reason, rejection_error(result, float(self.config.conductor.retry_after_s)))
        self.view.flights.begin(info, result, now, max_tokens=work.max_tokens, client_id=work.client_id)
        self.placement = result
        self.predicted_output_tokens = predicted_tokens
        logger.debug("placed: prefill %s, decode %s, prefix %d blocks (%d local, fetch %s), predicted TTFT %.3f s",
                     result.prefill_instance or "inline", result.decode_instance, result.num_prefix_blocks,
                     result.num_local_prefix_blocks, result.fetch_from_store, result.predicted_ttft_s)
        return result

    # ---- legs ---------------------------------------------------------------------------------------------
    async def reserve(self) -> ReserveReply:
        placement, work, conductor = self._placed(), self.work, self.config.conductor
        lease_s = conductor.prefill_timeout_s + self.config.rpc.call_timeout_s
        request = ReserveRequest(work.leg_id, list(work.block_keys), len(work.token_ids), work.sampling.max_tokens,
                                 min(int(lease_s * 1000), self.config.store.max_lease_ms),
                                 is_inline_prefill=not placement.prefill_instance, tenant=work.tenant,
                                 priority=work.sampling.priority, is_batch=work.sampling.is_batch,
                                 conductor_run=self.view.run_id, decode_start_s=placement.predicted_decode_start_s,
                                 predicted_output_tokens=self.predicted_output_tokens,
                                 num_sequences=work.sampling.num_sequences)
        self.may_hold_reservation = True  # from here a cancel or a lost reply may leave one behind
        waits = self.config.scheduler.admission in ("none", "baseline")  # RESERVE waits for room there
        timeout_s = conductor.prefill_timeout_s if waits else self.config.rpc.call_timeout_s
        try:
            reply = await self._client(placement.decode_instance).call(RESERVE, request, timeout_s=timeout_s)
        except RpcError as exc:
            raise self._failure("reserve", placement.decode_instance, exc) from None
        if not reply.is_accepted:
            self.may_hold_reservation = False
            logger.info("decode instance %s refused: %s", placement.decode_instance, reply.reason)
            if reply.reason.startswith("switching:"):  # it is changing role: another decode instance may take it
                raise LegFailed("reserve_lost", placement.decode_instance,
                                unavailable(f"decode instance {placement.decode_instance} is switching roles"))
            error = overloaded(f"decode instance {placement.decode_instance} refused it: {reply.reason}",
                               float(conductor.retry_after_s))
            raise Rejected(rejection_reason(reply.reason), error)
        return reply

    async def prefill(self, reservation: ReserveReply) -> PrefillReply:
        placement, work = self._placed(), self.work
        fetch_store = placement.fetch_from_store or ""
        request = PrefillRequest(
            work.leg_id, list(work.token_ids), list(work.block_keys), work.sampling, fetch_store=fetch_store,
            num_fetch_blocks=placement.num_prefix_blocks if fetch_store else 0,
            decode_store=reservation.store_instance, destinations=list(reservation.destinations),
            key_isolation=work.key_isolation, tenant=work.tenant)
        try:
            reply = await self._client(placement.prefill_instance).call(
                PREFILL, request, timeout_s=self.config.conductor.prefill_timeout_s)
        except RpcError as exc:
            raise self._failure("prefill", placement.prefill_instance, exc) from None
        self.view.flights.prefill_done(work.leg_id)
        return reply

    def open_decode(self, first_tokens: list[TokenSample], max_tokens: int) -> None:
        """`first_tokens`: every sequence's, from the prefill ([]: prefill inline on the decode instance)."""
        placement, work, conductor = self._placed(), self.work, self.config.conductor
        request = DecodeRequest(work.leg_id, list(work.token_ids), list(work.block_keys),
                                dataclasses.replace(work.sampling, max_tokens=max_tokens),
                                first_tokens[0] if first_tokens else None, key_isolation=work.key_isolation,
                                tenant=work.tenant, more_first_tokens=first_tokens[1:])
        stream_s = conductor.first_token_timeout_s + max_tokens * conductor.token_timeout_s
        self.decode_stream = self._client(placement.decode_instance).stream(DECODE, request, timeout_s=stream_s)
        self.view.flights.decode_started(work.leg_id, time.monotonic())

    async def next_item(self) -> DecodeItem:
        assert self.decode_stream is not None
        instance, conductor = self._placed().decode_instance, self.config.conductor
        timeout_s = conductor.token_timeout_s if self.num_decode_items else conductor.first_token_timeout_s
        self.is_decode_sent = True  # the stream sends its request on the first anext
        is_reported_down = False
        loop = asyncio.get_running_loop()
        waiting_since = loop.time()
        try:
            async with asyncio.timeout(timeout_s) as scope:

                def give_up() -> None:  # the instance is down (a stopped process keeps its sockets open)
                    nonlocal is_reported_down
                    # a stream that has waited less than a poll's deadline may only have met one slow poll of a
                    # busy instance; while the instance stays down, each later failed poll asks again
                    if not is_reported_down and loop.time() - waiting_since >= conductor.load_poll_timeout_s:
                        is_reported_down = True
                        scope.reschedule(loop.time())

                stop_watching = self.view.health.watch_down(instance, give_up)
                try:
                    item = await anext(self.decode_stream)
                finally:
                    stop_watching()
        except StopAsyncIteration:
            raise internal_error("The decode instance ended the stream without a finish reason.") from None
        except TimeoutError:
            if is_reported_down:
                error = unavailable(f"The decode instance {instance} stopped answering; retry shortly.")
                raise LegFailed("decode_lost", instance, error) from None
            error = deadline_exceeded(f"No token from decode instance {instance} within {timeout_s:g} s.")
            raise LegFailed("decode_deadline", instance, error) from None
        except RpcError as exc:
            raise self._failure("decode", instance, exc) from None
        self.num_decode_items += 1
        return item

    def _failure(self, leg: str, instance: str, exc: RpcError) -> Exception:
        """What the failed leg raises (leg_failures.py); reports the instance down when it did not answer."""
        logger.warning("%s leg on %s failed: %s", leg, instance, exc)
        return leg_failure(leg, instance, exc, leg_id=self.work.leg_id, placement=self.placement,
                           retry_after_s=float(self.config.conductor.retry_after_s),
                           report_down=self.view.health.report_failure)

    # ---- settling -----------------------------------------------------------------------------------------
    async def settle(self) -> None:
        """Idempotent."""
        if self.is_settled:
            return
        self.is_settled = True
        try:
            if self.decode_stream is not None:
                if self.is_decode_owed:
                    await self._drain_decode()
                await aclose(self.decode_stream)
            if self.may_hold_reservation and not self.is_decode_sent:
                await self._unreserve()
        finally:
            self.view.flights.finish(self.work.leg_id)

    async def _drain_decode(self) -> None:
        """Run the owed DECODE (max_tokens 1) to its end: the decode instance commits and frees the request."""
        assert self.decode_stream is not None
        self.is_decode_sent = True
        try:
            async with asyncio.timeout(self.config.conductor.first_token_timeout_s):
                async for _ in self.decode_stream:
                    pass
        except (RpcError, TimeoutError) as exc:
            logger.warning("the closing decode leg failed: %s", exc)

    async def _unreserve(self) -> None:
        """Give back a reservation DECODE will never claim; a failure only leaves it to its lease."""
        instance = self._placed().decode_instance
        timeout_s = min(UNRESERVE_TIMEOUT_S, self.config.rpc.call_timeout_s)
        try:
            reply = await self._client(instance).call(UNRESERVE, UnreserveRequest(self.work.leg_id),
                                                      timeout_s=timeout_s)
        except RpcError as exc:
            logger.warning("unreserve on %s failed (its lease frees it): %s", instance, exc)
            return
        logger.debug("unreserved on %s (was reserved: %s)", instance, reply.was_reserved)

    def _placed(self) -> Placement:
        assert self.placement is not None, "place() first"
        return self.placement

    def _client(self, instance_name: str) -> RpcClient:
        return self.peers.for_instance(self.view.instance_config(instance_name))
