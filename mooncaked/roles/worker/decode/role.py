"""The decode role (docs/design.md section 3, steps 2 and 5): reserve, load the prefilled KV, decode in a batch.

1. RESERVE (admission.py, over the rule in sched/decode_admission.py): check the batch's room (and, by admission
   policy, the TBT SLO with this instance's own fitted model; under `none` and `baseline` a request waits for room
   instead, the waiting ones taking it interactive first, then by priority and arrival), set pages aside, and
   allocate store space on this host for the prompt blocks it lacks (plus a private block for the partial tail);
   the reply names them. A reservation lives until DECODE claims it or its lease runs out.
2. DECODE with a first token: load the prompt's blocks from this host's store (the prefill instance wrote them)
   into pages layer by layer, layer i+1's read under way while layer i is copied into the pages, off the
   compute thread (running sequences keep decoding meanwhile); commit the full blocks (they become cache
   here), drop the tail block and join the batch; when that first token ended the request (max_tokens 1),
   only commit the blocks (sequences.commit_only: no page is taken). DECODE without one: prefill inline (the
   colocated path, inline_prefill.py), then join. A parallel sampling's further sequences (`num_sequences`, their
   first tokens drawn by the same prefill) share the prompt's full-block pages and copy only its partial last
   block (sequences.py), and join as sequences of their own; RESERVE set aside the shared pages once and each
   sequence's own (`decode_num_pages`).
3. Stream one item per step (several when the consumer lags), each naming its sequence, until every sequence
   ended at EOS, a stop token or max_tokens; when the stream ends for any reason, leave the batch and free the
   pages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from mooncaked.cluster.membership import Membership
from mooncaked.config import Config, InstanceConfig
from mooncaked.kv.keys import isolated_namespace
from mooncaked.model.sampler import make_generator
from mooncaked.roles.base import RoleEndpoint
from mooncaked.roles.worker.decode.admission import ReserveAdmission
from mooncaked.roles.worker.decode.inline_prefill import InlinePrefill
from mooncaked.roles.worker.decode.loop import DecodeLoop, Outbox, RunningSeq, finish_reason_for
from mooncaked.roles.worker.decode.reservations import Reservation, ReservationBook
from mooncaked.roles.worker.decode.sequences import commit_only, commit_prefilled, fork, load_prefilled, stream_items
from mooncaked.roles.worker.grammar import follow_first_token
from mooncaked.roles.worker.kv.device_report import device_cache_report
from mooncaked.roles.worker.kv.plan import check_block_keys
from mooncaked.roles.worker.messages import (DECODE, DecodeItem, DecodeRequest, LOAD, LoadReply, LoadRequest, RESERVE,
                                             ReserveReply, ReserveRequest, UNRESERVE,
                                             UnreserveReply, UnreserveRequest)
from mooncaked.roles.worker.profiler import profile
from mooncaked.roles.worker.sampling import history_of, sequence_params, to_params
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext, InvalidArgument, NotFound, ResourceExhausted
from mooncaked.runtime.logs import request_id_var
from mooncaked.runtime.metrics import Metrics
from mooncaked.runtime.metrics_http import MetricsEndpoint
from mooncaked.sched.decode_admission import (REASON_PAGES_NOT_FREED, WAITING_POLICIES, capacity_refusal,
                                              refusal_after_prefill)
from mooncaked.sched.decode_memory import decode_num_pages, is_decoding

logger = logging.getLogger(__name__)


class DecodeRole:
    """Owns the worker, the reservation book, the decode loop and the RESERVE admission (with its waiting calls)."""

    name = "decode"

    def __init__(self, config: Config, instance: InstanceConfig, membership: Membership | None = None,
                 worker: Worker | None = None) -> None:
        self.config = config
        self.instance = instance
        self.worker = worker or Worker(config, instance, membership)
        self.metrics = Metrics()
        self.metrics_endpoint = MetricsEndpoint(instance.host, instance.metrics_port, self.metrics,
                                                self._refresh_metrics)
        self.loop = DecodeLoop(self.worker, on_step=self._observe_step)
        self.reservations = ReservationBook(self.worker, lambda: len(self.loop.running))
        self.endpoint = RoleEndpoint(config, instance, extra_info=self._info,
                                     is_healthy=lambda: not self.worker.failed.is_set())
        self.endpoint.add_method(RESERVE, self._reserve)
        self.endpoint.add_method(UNRESERVE, self._unreserve)
        self.endpoint.add_method(DECODE, self._decode)
        self.endpoint.add_method(LOAD, self._load, is_eager=True)
        self.admission = ReserveAdmission(config, self.worker, self.loop, self.reservations)
        self.inline = InlinePrefill(self.worker, config.transfer.timeout_s)

    @property
    def failed(self) -> asyncio.Event:
        """Set when the instance cannot serve any more (a tensor-parallel rank exited): serve() stops it and
        exits non-zero, so the supervisor restarts it."""
        return self.worker.failed

    async def start(self) -> None:
        await self.worker.start()
        await profile(self.worker, with_decode=True)
        self.activate()
        await self.endpoint.start()
        await self.metrics_endpoint.start()

    async def stop(self) -> None:
        await self.metrics_endpoint.stop()
        await self.endpoint.stop()
        await self.deactivate()
        await self.reservations.close()
        await self.worker.stop()

    def activate(self) -> None:
        """Start the decode loop and the reservations' expiry on the (started) worker; a switchable instance calls
        this when it becomes decode."""
        self.loop.start()
        self.reservations.start()

    async def deactivate(self) -> None:
        """Stop the loop (its sequences end with an error) and give back every reservation; the worker stays."""
        await self.loop.stop()
        await self.reservations.stop()
        for request_id in list(self.reservations.by_id):
            await self.reservations.drop(request_id, is_prefill_done=False)

    @property
    def is_idle(self) -> bool:
        return not self.loop.running and not self.reservations and not self.inline.num_running

    def _refresh_metrics(self) -> None:
        self.metrics.queues.set_length("decode", len(self.reservations))
        self.metrics.queues.set_length("decode_pages", self.reservations.num_queued())

    def _observe_step(self, num_seqs: int, step_s: float) -> None:
        self.metrics.engine.observe_step("decode", num_requests=num_seqs, num_tokens=num_seqs, step_s=step_s)

    def _info(self) -> dict[str, str]:
        return {"running": str(len(self.loop.running)), "reservations": str(len(self.reservations))}

    async def _load(self, request: LoadRequest, ctx: CallContext) -> LoadReply:
        pages = self.worker.pages
        assert pages is not None
        await self.reservations.drop_orphans(ctx.peer_instance, request.conductor_run)
        coefficients = self.worker.perf.coefficients()
        return LoadReply(role="decode", num_running=len(self.loop.running), num_waiting=len(self.reservations),
                         num_queued_tokens=0, num_free_pages=pages.num_free,
                         num_pages=pages.num_pages, step_time_s=self.loop.mean_step_s,
                         num_context_tokens=self.loop.num_context_tokens,
                         prefill_coefficients=list(coefficients.prefill), decode_coefficients=list(coefficients.decode),
                         overhead_s=self.inline.overhead.value, kv_cache_bytes=self.worker.kv_cache_bytes,
                         num_queued_pages=self.reservations.num_queued_pages(),
                         num_reserving=len(self.admission.waiting),
                         num_prefilling=self.reservations.num_prefilling(), drain_s=self.admission.drain_s(),
                         held_request_ids=[seq.request_id for seq in self.loop.running]
                         + list(self.reservations.by_id),
                         **device_cache_report(self.worker, request.device_cache_seq))

    # ---- 1. reserve ------------------------------------------------------------------------------------
    async def _reserve(self, request: ReserveRequest, ctx: CallContext) -> ReserveReply:
        request_id_var.set(request.request_id)
        if request.request_id in self.reservations:
            raise InvalidArgument(f"request {request.request_id} is already reserved")
        if min(request.max_tokens, request.num_prompt_tokens, request.lease_ms, request.num_sequences) < 1:
            raise InvalidArgument("num_prompt_tokens, max_tokens, lease_ms and num_sequences must be >= 1")
        if request.lease_ms > self.config.store.max_lease_ms:
            raise InvalidArgument(f"lease_ms must be at most store.max_lease_ms ({self.config.store.max_lease_ms}), "
                                  f"got {request.lease_ms}")
        await self.reservations.expire()
        await self.reservations.drop_orphans(ctx.peer_instance, request.conductor_run)
        is_decoded = is_decoding(request.max_tokens, request.is_inline_prefill)
        num_pages = decode_num_pages(request.num_prompt_tokens, request.max_tokens, self.worker.block_size,
                                     request.num_sequences, is_inline_prefill=request.is_inline_prefill)
        if reason := capacity_refusal(num_pages, self.worker.num_pages):
            return ReserveReply(is_accepted=False, reason=reason)
        reason = self.admission.refusal(request, num_pages) if is_decoded else ""
        if is_decoded and (reason or self.admission.waiting) and self.config.scheduler.admission in WAITING_POLICIES:
            reason = await self.admission.wait_for_room(request, num_pages, ctx)
        if reason:
            return ReserveReply(is_accepted=False, reason=reason)
        is_at_decode = self.config.scheduler.admission == "early_rejection_predicted"
        reservation = self.reservations.add(request, num_pages, ctx.peer_instance, is_at_decode)
        if self.admission.waiting:
            await self.reservations.room.freed()  # the next in line may fit beside it
        if request.is_inline_prefill:
            return ReserveReply(is_accepted=True, store_instance=self.worker.stores.local_name)
        try:
            await self.admission.allocate_store(reservation, ctx)
        except ResourceExhausted as exc:
            await self.reservations.drop(request.request_id)
            return ReserveReply(is_accepted=False, reason=f"store: {exc.message}")
        except BaseException:
            await self.reservations.drop(request.request_id)
            raise
        return self.reservations.reply(reservation)

    async def _unreserve(self, request: UnreserveRequest, ctx: CallContext) -> UnreserveReply:
        was_reserved = request.request_id in self.reservations
        await self.reservations.drop(request.request_id, is_prefill_done=False)
        return UnreserveReply(was_reserved=was_reserved)

    # ---- 2. claim: load prefilled KV, or prefill inline ------------------------------------------------
    def _claim(self, request: DecodeRequest) -> Reservation:
        reservation = self.reservations.get(request.request_id)
        if reservation is None:
            raise NotFound(f"no reservation for request {request.request_id}: reserve first (or it expired)")
        if reservation.is_claimed:
            raise InvalidArgument(f"request {request.request_id} is already decoding")
        if len(request.token_ids) != reservation.request.num_prompt_tokens:
            raise InvalidArgument("token_ids do not match the reserved num_prompt_tokens")
        check_block_keys(self.worker, request.token_ids, request.block_keys, request.key_isolation)
        return reservation

    # ---- 3. stream -------------------------------------------------------------------------------------
    async def _decode(self, request: DecodeRequest, ctx: CallContext) -> AsyncIterator[DecodeItem]:
        request_id_var.set(request.request_id)
        spec, num_seqs = request.sampling, request.sampling.num_sequences
        params = to_params(spec, self.worker.vocab_size)
        history_of(request.token_ids, params, spec.num_sampled)
        if request.first_token is not None and len(request.more_first_tokens) != num_seqs - 1:
            raise InvalidArgument(f"{num_seqs} sequences need {num_seqs - 1} more first tokens")
        assert self.worker.grammar is not None
        grammars = [self.worker.grammar.state_for(spec, request.token_ids) for _ in range(num_seqs)]
        reservation = self._claim(request)
        reservation.is_claimed = True
        if request.first_token is not None and spec.max_tokens == 1:
            async for item in commit_only(self.worker, self.reservations, request, reservation, params):
                yield item
            return
        self.reservations.grant()  # one wanted at DECODE joins the page queue now
        num_cached_tokens, prompt_logprobs, kvs = 0, [], []
        try:
            await self._wait_for_pages(reservation, ctx)
            refusal = refusal_after_prefill(self.config.scheduler.admission, len(self.loop.running),
                                            self.loop.num_context_tokens, len(request.token_ids),
                                            self.admission.step_limit())
            if refusal and request.first_token is not None:
                raise ResourceExhausted(refusal)
            if request.first_token is None:
                kv, result, num_cached_tokens = await self.inline.run(request, reservation, ctx, grammars)
                firsts = [result.first_tokens[0], *result.more_first_tokens[0]]
                prompt_logprobs = result.prompt_logprobs[0]
            else:
                firsts = [request.first_token, *request.more_first_tokens]
                for grammar, first in zip(grammars, firsts):
                    if grammar is not None:
                        follow_first_token(grammar, first.token_id)
                kv = await load_prefilled(self.worker, request, reservation)
            kvs.append(kv)
            self.metrics.cache.observe_device_prefix(num_blocks=kv.num_device_blocks,
                                                     num_cached=self.worker.pages.num_cached if self.worker.pages
                                                     else 0)
            for sequence in range(1, num_seqs):
                kvs.append(await fork(self.worker, kv, f"{request.request_id}#{sequence}", spec.max_tokens,
                                      reserved_by=reservation.owner))
        except BaseException:
            for kv in kvs:
                await kv.release()
            raise
        finally:
            await self.reservations.drop(request.request_id)
        outbox: Outbox = asyncio.Queue()
        seqs = [RunningSeq(request.request_id, kv, list(request.token_ids) + [first.token_id], len(request.token_ids),
                           sequence_params(params, q), make_generator(sequence_params(params, q)), outbox,
                           num_sampled_before=spec.num_sampled, grammar=grammars[q], sequence=q,
                           predicted_num_tokens=reservation.request.predicted_output_tokens)
                for q, (kv, first) in enumerate(zip(kvs, firsts))]
        try:
            assert self.worker.loaded is not None
            for seq, first in zip(seqs, firsts):
                reason = finish_reason_for(seq, first.token_id, self.worker.loaded.eos_token_ids,
                                           self.config.model.max_model_len)
                item = DecodeItem(tokens=[first] if request.first_token is None else [], finish_reason=reason,
                                  num_cached_tokens=num_cached_tokens, prompt_logprobs=prompt_logprobs,
                                  sequence=seq.sequence)
                if item.tokens or reason:
                    yield item
                seq.finish_reason = reason
            running = [seq for seq in seqs if not seq.finish_reason]
            for seq in running:
                self.loop.add(seq)
            async for item in stream_items(outbox, len(running), self.config.conductor.token_timeout_s):
                yield item
        finally:
            namespace = isolated_namespace(self.worker.namespace, request.key_isolation)
            for seq in seqs:
                await self.loop.remove(seq)
                seq.kv.mark_complete_through(seq.token_ids[:-1], namespace)  # output blocks to the device tier
                await seq.kv.release()
            await self.reservations.pages_freed()

    async def _wait_for_pages(self, reservation: Reservation, ctx: CallContext) -> None:
        """A reservation admitted on a forecast may still wait for its pages (a sequence ran longer than predicted):
        until its page deadline. Past it the prompt's prefilled blocks are committed here (cache for the next
        attempt) and the request is told to move (REASON_PAGES_NOT_FREED: the conductor migrates it)."""
        if not reservation.granted.is_set():
            self.metrics.reservations_waited_total.inc()
        if await self.reservations.wait_granted(reservation, min(reservation.page_deadline, ctx.deadline)):
            return
        self.metrics.page_wait_timeouts_total.inc()
        await commit_prefilled(self.worker, reservation)
        free = self.worker.pages.num_free if self.worker.pages is not None else 0
        raise ResourceExhausted(f"{REASON_PAGES_NOT_FREED}: {reservation.num_pages} KV pages were not freed by the "
                                f"predicted decode start plus {self.worker.section.page_wait_s:g} s ({free} free)")
