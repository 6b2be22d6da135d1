"""The decode role (DESIGN 3, steps 2 and 5): reserve, load the prefilled KV, decode in a continuous batch.

1. RESERVE: check the batch's room and the TBT SLO with this instance's own view, set pages aside, and
   allocate store space on this host for the prompt blocks it lacks (plus a private block for the partial
   tail); the reply names them. A reservation lives until DECODE claims it or its lease runs out.
2. DECODE with a first token: load the prompt's blocks from this host's store (the prefill instance wrote them)
   into pages layer by layer, layer i+1's read under way while layer i is copied into the pages, off the
   compute thread (running sequences keep decoding meanwhile); commit the full blocks (they become cache
   here), drop the tail block and join the batch. DECODE without one: prefill inline (the colocated path),
   then join.
3. Stream one item per step (several when the consumer lags) until EOS, a stop token or max_tokens; when the
   stream ends for any reason, leave the batch and free the pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mooncaked.config import Config, InstanceConfig
from mooncaked.kv.messages import BlockLocation, WriteHandle
from mooncaked.logs import request_id_var
from mooncaked.model.sampler import make_generator
from mooncaked.metrics import Metrics
from mooncaked.roles.base import RoleEndpoint
from mooncaked.roles.metrics_http import MetricsEndpoint
from mooncaked.roles.worker.decode_loop import DecodeLoop, RunningSeq, finish_reason_for
from mooncaked.roles.worker.kv_plan import check_block_keys, plan_prompt_kv
from mooncaked.roles.worker.messages import (DECODE, LOAD, RESERVE, DecodeItem, DecodeRequest, Destination, LoadReply,
                                             LoadRequest, ReserveReply, ReserveRequest, TokenSample, UNRESERVE,
                                             UnreserveReply, UnreserveRequest)
from mooncaked.roles.worker.prefill_forward import run_prefill_forward
from mooncaked.roles.worker.request_kv import BlockSource, RequestKv, num_blocks_for
from mooncaked.roles.worker.sampling import to_params
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext, InvalidArgument, NotFound, ResourceExhausted

logger = logging.getLogger(__name__)


@dataclass
class Reservation:
    """Pages set aside and store space allocated for one request; owned by the DecodeRole until claimed."""

    request: ReserveRequest
    num_pages: int
    expires_at: float
    handles: list[WriteHandle] = field(default_factory=list)
    present: list[BlockLocation] = field(default_factory=list)
    lease_id: int = 0
    tail: WriteHandle | None = None


class DecodeRole:
    """Owns the worker, the reservations and the decode loop."""

    name = "decode"

    def __init__(self, config: Config, instance: InstanceConfig) -> None:
        self.config = config
        self.instance = instance
        self.worker = Worker(config, instance)
        self.metrics = Metrics()
        self.metrics_endpoint = MetricsEndpoint(instance.host, instance.metrics_port, self.metrics,
                                                self._refresh_metrics)
        self.loop = DecodeLoop(self.worker, on_step=self._observe_step)
        self.reservations: dict[str, Reservation] = {}
        self.endpoint = RoleEndpoint(config, instance, extra_info=self._info)
        self.endpoint.add_method(RESERVE, self._reserve)
        self.endpoint.add_method(UNRESERVE, self._unreserve)
        self.endpoint.add_method(DECODE, self._decode)
        self.endpoint.add_method(LOAD, self._load, is_eager=True)
        self._num_prefilling = 0
        self._deferred_aborts: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.worker.start()
        self.loop.start()
        await self.endpoint.start()
        await self.metrics_endpoint.start()

    async def stop(self) -> None:
        await self.metrics_endpoint.stop()
        await self.endpoint.stop()
        await self.loop.stop()
        for request_id in list(self.reservations):
            await self._drop_reservation(request_id, is_prefill_done=False)
        for task in list(self._deferred_aborts):  # the store reclaims those handles when their leases expire
            task.cancel()
        await asyncio.gather(*self._deferred_aborts, return_exceptions=True)
        await self.worker.stop()

    def _refresh_metrics(self) -> None:
        self.metrics.queues.set_length("decode", len(self.reservations))

    def _observe_step(self, num_seqs: int, step_s: float) -> None:
        self.metrics.engine.observe_step("decode", num_requests=num_seqs, num_tokens=num_seqs, step_s=step_s)

    def _info(self) -> dict[str, str]:
        return {"running": str(len(self.loop.running)), "reservations": str(len(self.reservations))}

    async def _load(self, request: LoadRequest, ctx: CallContext) -> LoadReply:
        pages = self.worker.pages
        assert pages is not None
        return LoadReply(role="decode", num_running=len(self.loop.running), num_waiting=len(self.reservations),
                         num_queued_tokens=0, num_free_pages=pages.num_free - self._reserved_pages(),
                         num_pages=self.worker.section.num_kv_pages, step_time_s=self.loop.mean_step_s,
                         num_context_tokens=self.loop.num_context_tokens)

    # ---- 1. reserve ------------------------------------------------------------------------------------
    def _reserved_pages(self) -> int:
        return sum(r.num_pages for r in self.reservations.values())

    async def _expire_reservations(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, res in self.reservations.items() if res.expires_at < now]:
            logger.info("reservation %s expired unclaimed", request_id)
            await self._drop_reservation(request_id, is_prefill_done=False)

    def _refusal(self, num_pages: int) -> str:
        pages = self.worker.pages
        assert pages is not None
        if num_pages > pages.num_free - self._reserved_pages():
            return f"memory: needs {num_pages} KV pages, {pages.num_free - self._reserved_pages()} free"
        num_seqs = len(self.loop.running) + len(self.reservations)
        if num_seqs >= self.worker.section.max_batch_size:
            return f"batch: {num_seqs} sequences running or reserved (max_batch_size)"
        step_s = self.loop.mean_step_s * (num_seqs + 1) / max(num_seqs, 1)
        if step_s * 1000 > self.config.scheduler.tbt_slo_ms:
            return f"tbt_slo: predicted step {step_s * 1000:.0f} ms > {self.config.scheduler.tbt_slo_ms:.0f} ms"
        return ""

    async def _reserve(self, request: ReserveRequest, ctx: CallContext) -> ReserveReply:
        request_id_var.set(request.request_id)
        if request.request_id in self.reservations:
            raise InvalidArgument(f"request {request.request_id} is already reserved")
        if request.max_tokens < 1 or request.num_prompt_tokens < 1 or request.lease_ms < 1:
            raise InvalidArgument("num_prompt_tokens, max_tokens and lease_ms must be >= 1")
        await self._expire_reservations()
        num_pages = num_blocks_for(request.num_prompt_tokens + request.max_tokens, self.worker.block_size)
        reason = self._refusal(num_pages)
        if reason:
            return ReserveReply(is_accepted=False, reason=reason)
        reservation = Reservation(request, num_pages, time.monotonic() + request.lease_ms / 1000)
        self.reservations[request.request_id] = reservation
        if request.is_inline_prefill:
            return ReserveReply(is_accepted=True, store_instance=self.worker.local_store_name)
        try:
            await self._allocate(reservation)
        except ResourceExhausted as exc:
            await self._drop_reservation(request.request_id)
            return ReserveReply(is_accepted=False, reason=f"store: {exc.message}")
        return self._reserve_reply(reservation)

    async def _allocate(self, reservation: Reservation) -> None:
        request, store = reservation.request, self.worker.local_store
        reply = await store.allocate(request.block_keys, self.worker.block_nbytes, request.lease_ms)
        reservation.handles, reservation.present, reservation.lease_id = reply.handles, reply.present, \
            reply.read_lease_id
        if request.num_prompt_tokens % self.worker.block_size:
            tail_key = hashlib.blake2b(request.request_id.encode() + os.urandom(8), digest_size=16).digest()
            tail = await store.allocate([tail_key], self.worker.block_nbytes, request.lease_ms)
            reservation.tail = tail.handles[0]

    def _reserve_reply(self, reservation: Reservation) -> ReserveReply:
        index_of = {key: i for i, key in enumerate(reservation.request.block_keys)}
        destinations = [Destination(index_of[h.key], h) for h in reservation.handles]
        if reservation.tail is not None:
            destinations.append(Destination(len(reservation.request.block_keys), reservation.tail))
        return ReserveReply(is_accepted=True, store_instance=self.worker.local_store_name,
                            destinations=destinations, num_present_blocks=len(reservation.present))

    async def _unreserve(self, request: UnreserveRequest, ctx: CallContext) -> UnreserveReply:
        was_reserved = request.request_id in self.reservations
        await self._drop_reservation(request.request_id, is_prefill_done=False)
        return UnreserveReply(was_reserved=was_reserved)

    async def _drop_reservation(self, request_id: str, is_prefill_done: bool = True) -> None:
        """Give the pages back at once; abort the store handles once no prefill can still write into them."""
        reservation = self.reservations.pop(request_id, None)
        if reservation is None:
            return
        handle_ids = [h.handle_id for h in reservation.handles]
        if reservation.tail is not None:
            handle_ids.append(reservation.tail.handle_id)
        delay_s = 0.0 if is_prefill_done else self.worker.section.abort_grace_s
        task = asyncio.create_task(self._end_store_handles(handle_ids, reservation.lease_id, delay_s))
        self._deferred_aborts.add(task)
        task.add_done_callback(self._deferred_aborts.discard)
        if is_prefill_done:
            await task

    async def _end_store_handles(self, handle_ids: list[int], lease_id: int, delay_s: float) -> None:
        store = self.worker.local_store
        with contextlib.suppress(Exception):  # else the store reclaims them at lease expiry
            if lease_id:
                await store.release([lease_id])
            await asyncio.sleep(delay_s)  # a cancelled prefill's writes in flight land in reserved space
            if handle_ids:
                await store.abort(handle_ids)

    # ---- 2. claim: load prefilled KV, or prefill inline ------------------------------------------------
    def _claim(self, request: DecodeRequest) -> Reservation:
        reservation = self.reservations.get(request.request_id)
        if reservation is None:
            raise NotFound(f"no reservation for request {request.request_id}: reserve first (or it expired)")
        if len(request.token_ids) != reservation.request.num_prompt_tokens:
            raise InvalidArgument("token_ids do not match the reserved num_prompt_tokens")
        check_block_keys(self.worker, request.token_ids, request.block_keys)
        return reservation

    async def _load_prefilled(self, request: DecodeRequest, reservation: Reservation) -> RequestKv:
        worker, store = self.worker, self.worker.local_store
        kv = RequestKv(worker, request.request_id, len(request.token_ids), reservation.request.max_tokens)
        try:
            index_of = {key: i for i, key in enumerate(request.block_keys)}
            blocks = [(index_of[loc.key], loc.offset) for loc in reservation.present]
            blocks += [(index_of[h.key], h.offset) for h in reservation.handles]
            if reservation.tail is not None:
                blocks.append((len(request.block_keys), reservation.tail.offset))
            kv.start_loading([BlockSource(worker.local_store_name, [i for i, _ in blocks], [o for _, o in blocks])],
                             kv.num_blocks)
            await kv.wait_loaded()
            if reservation.handles:
                await store.commit([h.handle_id for h in reservation.handles])
                reservation.handles = []
        except BaseException:
            await kv.release()
            raise
        return kv

    async def _prefill_inline(self, request: DecodeRequest, ctx: CallContext) -> tuple[RequestKv, TokenSample, int]:
        worker = self.worker
        plan = await plan_prompt_kv(worker, request.request_id, list(request.token_ids), request.block_keys,
                                    timeout_s=max(ctx.deadline - time.monotonic(), 0.001),
                                    num_extra_tokens=request.sampling.max_tokens)
        self._num_prefilling += 1
        try:
            sample = (await worker.compute(run_prefill_forward, worker, [plan], [request.sampling]))[0]
            await plan.kv.wait_writes(self.config.transfer.timeout_s)
            await plan.close_store(commit=True)
        except BaseException:
            await plan.close(commit=False)
            raise
        finally:
            self._num_prefilling -= 1
        return plan.kv, sample, plan.num_prefix_blocks * worker.block_size

    # ---- 3. stream -------------------------------------------------------------------------------------
    async def _decode(self, request: DecodeRequest, ctx: CallContext) -> AsyncIterator[DecodeItem]:
        request_id_var.set(request.request_id)
        params = to_params(request.sampling)
        reservation = self._claim(request)
        num_cached_tokens = 0
        try:
            if request.first_token is None:
                kv, first, num_cached_tokens = await self._prefill_inline(request, ctx)
            else:
                kv, first = await self._load_prefilled(request, reservation), request.first_token
        finally:
            await self._drop_reservation(request.request_id)
        seq = RunningSeq(request.request_id, kv, list(request.token_ids) + [first.token_id], len(request.token_ids),
                         params, make_generator(params))
        try:
            assert self.worker.loaded is not None
            reason = finish_reason_for(seq, first.token_id, self.worker.loaded.eos_token_ids,
                                       self.config.model.max_model_len)
            first_item = DecodeItem(tokens=[first] if request.first_token is None else [], finish_reason=reason,
                                    num_cached_tokens=num_cached_tokens)
            if first_item.tokens or reason:
                yield first_item
            if reason:
                return
            self.loop.add(seq)
            async for item in self._items(seq):
                yield item
        finally:
            await self.loop.remove(seq)
            await kv.release()

    async def _items(self, seq: RunningSeq) -> AsyncIterator[DecodeItem]:
        while True:
            entries = [await asyncio.wait_for(seq.outbox.get(), self.config.conductor.token_timeout_s)]
            while not seq.outbox.empty():
                entries.append(seq.outbox.get_nowait())
            tokens: list[TokenSample] = []
            for entry in entries:
                if isinstance(entry, BaseException):
                    raise entry
                sample, reason = entry
                tokens.append(sample)
                if reason:
                    yield DecodeItem(tokens=tokens, finish_reason=reason)
                    return
            yield DecodeItem(tokens=tokens)
