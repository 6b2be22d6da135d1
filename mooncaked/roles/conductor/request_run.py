"""One request across the cluster, driven by `ConductorBackend.generate` (docs/design.md section 3).

1. An attempt (`Leg`, leg.py) places the request (a Rejection is a 429 with Retry-After, or a 503 when no
   instance of a needed role is up), RESERVEs on the decode instance (under admission `none` and `baseline` it
   waits for room) and PREFILLs (fetching a remote prefix first when placed so); the first token goes out at
   once, with the placement's predicted TTFT and TBT. Placed inline, DECODE prefills on the decode instance.
   Under `baseline` the decode instance checks its load only when DECODE arrives, so the first token waits for
   DECODE's first item: a refusal there is a 429 and the prefill was wasted (paper section 6).
2. DECODE streams the rest; text and stop strings are handled here (`GenerationState`); a matched stop string
   ends the request and closes the stream, which cancels it on the decode instance.
3. Migration: when a leg fails in a way another instance may not (killed, unreachable, stopping, past its
   deadline), the attempt is settled and a new one serves the prompt plus every token already streamed, with
   the tokens left and the seed state (tokens sampled so far), on other instances, reusing the prefix KV the
   stores hold. The client's stream goes on: no token repeated or missing, usage counted once. At most
   `conductor.max_migrations` times; then, or with no instance left, the client gets the error.
4. Settle, however the request ended: settle the open attempt, then the run's `RunRecord` (run_record.py: the
   prefix reused and the token times, kept while serving) teaches the output-length predictor a naturally ended
   request's length, records how far the predictions were from what happened, and counts it (also by class). A
   rejected batch line is no answer: it is not counted as a rejection, and the batch queue runs it again; a
   rejected interactive request tells the batch queue to yield.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from mooncaked.api.backend import GenerationChunk
from mooncaked.api.errors import ApiError
from mooncaked.kv.keys import block_keys, isolated_namespace
from mooncaked.model.stopping import FINISH_LENGTH, FINISH_STOP, GenerationState
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.frontend import ConductorRequest, ModelFrontend
from mooncaked.roles.conductor.leg import Leg, LegWork, attempt_id
from mooncaked.roles.conductor.leg_failures import LegFailed, Rejected
from mooncaked.roles.conductor.logprobs import prompt_logprobs, token_logprobs
from mooncaked.roles.conductor.run_record import RecordSinks, RunRecord
from mooncaked.roles.worker.messages import FINISH_EOS, PrefillReply, SamplingSpec, StoreTenant, TokenSample
from mooncaked.runtime.logs import request_id_var
from mooncaked.sched.types import Placement

logger = logging.getLogger(__name__)


class RunServices(RecordSinks, Protocol):
    """What a request's run borrows from the conductor's backend (which owns `num_active`)."""

    model: ModelFrontend
    peers: PeerClients
    namespace: bytes
    num_active: int

    def update_queue_metrics(self) -> None: ...

    def interactive_rejected(self, reason: str) -> None: ...


class RequestRun:
    """One request. Owns its current `Leg`, its `GenerationState`s (one per sequence: parallel sampling), its
    migration count and its `RunRecord` until `chunks()` closes."""

    def __init__(self, backend: RunServices, prepared: ConductorRequest, states: Sequence[GenerationState],
                 sampling: SamplingSpec) -> None:
        self.backend = backend
        self.config = backend.config
        self.view = backend.view
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.states = list(states)
        self.state = states[0]  # a single sequence's: what a migration continues
        self.sampling = sampling  # max_tokens is the request's; a leg may ask for fewer
        self.leg: Leg | None = None
        self.first_placement: Placement | None = None
        self.failed_instances: set[str] = set()
        self.num_migrations = 0
        self.record = RunRecord(backend, prepared)
        self.prompt_logprobs: list[TokenSample] | None = None  # asked for: from the prefill (or inline) leg
        self.status = "cancelled"  # until the request finishes or fails

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        request_id_var.set(self.request_id)
        self.backend.num_active += 1
        try:
            while True:
                self.leg = Leg(self.config, self.view, self.backend.peers, self._work())
                try:
                    async for chunk in self._serve(self.leg):
                        yield chunk
                    return
                except LegFailed as failure:
                    await self._migrate(failure)
        except Rejected as rejection:
            self._reject(rejection.reason)
            raise rejection.error from None
        except LegFailed as failure:
            self.status = "timeout" if failure.error.status == 504 else "failed"
            raise failure.error from None
        except ApiError as error:
            self.status = "timeout" if error.status == 504 else "failed"
            raise
        except Exception:
            self.status = "failed"
            raise
        finally:
            await self._settle()

    def _work(self) -> LegWork:
        """The first attempt serves the prompt; a migrated one the prompt plus every token already streamed."""
        prepared, output = self.prepared, tuple(self.state.output_ids)
        sampling = dataclasses.replace(self.sampling, max_tokens=prepared.max_tokens - len(output),
                                       num_sampled=len(output),
                                       num_prompt_logprobs=None if output else self.sampling.num_prompt_logprobs)
        leg_id = attempt_id(self.request_id, self.num_migrations)
        token_ids = prepared.prompt_token_ids + output
        namespace = isolated_namespace(self.backend.namespace, prepared.key_isolation)
        keys = prepared.block_keys if not output else tuple(
            block_keys(list(token_ids), self.config.kv.block_size, namespace))
        tenant = prepared.request.tenant
        owner = StoreTenant(tenant.id, tenant.pool_share or 0.0, tenant.min_pool_share) if tenant else None
        return LegWork(leg_id, token_ids, keys, sampling, prepared.arrival_time, prepared.max_tokens,
                       prepared.request.client_id, prepared.key_isolation, owner)

    async def _serve(self, leg: Leg) -> AsyncIterator[GenerationChunk]:
        placement = leg.place(frozenset(self.failed_instances))
        self.first_placement = self.first_placement or placement
        self.backend.update_queue_metrics()
        reservation = await leg.reserve()
        if placement.prefill_instance:
            reply = await leg.prefill(reservation)
            self._record_prefill(reply)
            firsts = [reply.first_token, *reply.more_first_tokens]
            chunks = [self._make_chunk([token], "", sequence) for sequence, token in enumerate(firsts)]
            leg.is_decode_owed = self.is_done
            leg.open_decode(firsts, 1 if leg.is_decode_owed else leg.work.sampling.max_tokens)
            self.backend.update_queue_metrics()
            admitted = await self._admitted_after_prefill(leg) if not self.is_done else None
            for chunk in chunks:
                if chunk is not None:
                    yield chunk
            if self.is_done:
                return
            if admitted is not None:
                yield admitted
                if self.is_done:
                    return
        else:
            leg.open_decode([], leg.work.sampling.max_tokens)
            self.backend.update_queue_metrics()
        while True:
            next_chunk = await self._next_chunk(leg)
            if next_chunk is not None:
                yield next_chunk
                if self.is_done:
                    return

    @property
    def is_done(self) -> bool:
        """Every sequence has finished (one ended by a stop string may still run on the decode instance)."""
        return all(state.finish_reason is not None for state in self.states)

    async def _admitted_after_prefill(self, leg: Leg) -> GenerationChunk | None:
        """DECODE's first item, before the first token goes out, under `baseline` (the decode instance's admission
        check happens on its arrival) and for a placement whose decode start the memory forecast deferred (the
        stream then starts when its decode does, with no pause after its first token: the wait counts in TTFT,
        which the deferral keeps within its SLO)."""
        is_deferred = leg.placement is not None and leg.placement.decode_defer_s > 0
        if self.config.scheduler.admission != "baseline" and not is_deferred:
            return None
        return await self._next_chunk(leg)

    async def _next_chunk(self, leg: Leg) -> GenerationChunk | None:
        item = await leg.next_item()
        if item.num_cached_tokens and leg.placement is not None and not leg.placement.prefill_instance:
            self.record.observe_prefix(item.num_cached_tokens, 0)
        if self.sampling.num_prompt_logprobs is not None and self.prompt_logprobs is None and item.tokens:
            self.prompt_logprobs = list(item.prompt_logprobs)
        return self._make_chunk(item.tokens, item.finish_reason, item.sequence)

    async def _migrate(self, failure: LegFailed) -> None:
        """Settle the failed attempt; raise its error when the request may not move again."""
        assert self.leg is not None
        await self.leg.settle()
        if failure.cause != "decode_pages":  # short of pages, not failed: it may take the request again later
            self.failed_instances.add(failure.instance)
        if self.num_migrations >= self.config.conductor.max_migrations or self.state.finish_reason is not None \
                or len(self.states) > 1:  # a parallel sampling does not migrate: its sequences went apart
            logger.warning("%s; not migrating again (%d migrations)", failure, self.num_migrations)
            raise failure
        self.num_migrations += 1
        self.backend.metrics.requests.observe_migration(failure.cause)
        logger.warning("%s; migrating after %d streamed tokens (migration %d)", failure,
                       len(self.state.output_ids), self.num_migrations)

    def _reject(self, reason: str) -> None:
        self.status = "rejected"
        if self.prepared.request.is_batch:  # not an answer: the batch queue runs the line again later
            logger.info("batch line deferred: %s", reason)
            return
        self.backend.metrics.requests.observe_rejection(reason)
        tenant = self.prepared.request.tenant
        if tenant is not None:
            self.backend.metrics.tenants.observe_rejection(tenant.id, reason)
        self.backend.interactive_rejected(reason)
        logger.info("rejected: %s", reason)

    # ---- output -------------------------------------------------------------------------------------------
    def _make_chunk(self, samples: Sequence[TokenSample], decode_finish: str,
                    sequence: int = 0) -> GenerationChunk | None:
        state = self.states[sequence]
        if state.finish_reason is not None:
            return None  # ended by a stop string here; the decode instance runs it on until the request ends
        token_ids: list[int] = []
        texts: list[str] = []
        finish_reason: str | None = None
        for sample in samples:
            step = state.append(sample.token_id)
            token_ids.append(sample.token_id)
            texts.append(step.text)
            if step.finish_reason is not None:
                finish_reason = step.finish_reason
                break
        if finish_reason is None and decode_finish:
            texts.append(state.matcher.feed(state.detokenizer.flush()) + state.matcher.flush())
            finish_reason = FINISH_STOP if decode_finish == FINISH_EOS else FINISH_LENGTH
            state.finish_reason = finish_reason
        if not token_ids and finish_reason is None:
            return None
        is_first = False
        if token_ids:
            is_first = self.record.observe_tokens()
            if self.leg is not None:
                self.view.flights.generated(self.leg.work.leg_id, len(self.state.output_ids))
        if self.is_done:
            self.status = "ok"
        tokenizer = self.backend.model.tokenizer
        logprobs = token_logprobs(tokenizer, samples[: len(token_ids)]) \
            if self.sampling.num_logprobs is not None else None  # best_of asks for them to rank its sequences
        placement = self.first_placement if is_first else None
        prompt = prompt_logprobs(tokenizer, self.prepared.prompt_token_ids, self.prompt_logprobs) \
            if is_first and self.prompt_logprobs is not None else None
        return GenerationChunk(tuple(token_ids), "".join(texts), logprobs, finish_reason,
                               self.prepared.num_prompt_tokens, self.record.num_cached_tokens,
                               placement.predicted_decode_start_s if placement else None,  # deferred: its wait
                               placement.predicted_tbt_s if placement else None, prompt_logprobs=prompt,
                               index=sequence)

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def _record_prefill(self, reply: PrefillReply) -> None:
        if self.sampling.num_prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(reply.prompt_logprobs)
        placement = self.leg.placement if self.leg is not None else None
        self.record.observe_prefill(reply, placement, is_migrated=self.num_migrations > 0)

    async def _settle(self) -> None:
        try:
            if self.leg is not None:
                await self.leg.settle()
        finally:
            self.backend.num_active -= 1
            self.backend.update_queue_metrics()
            num_output_tokens = sum(len(state.output_ids) for state in self.states)
            self.record.report(status=self.status, num_output_tokens=num_output_tokens,
                               first_placement=self.first_placement)
