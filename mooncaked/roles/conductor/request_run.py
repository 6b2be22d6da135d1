"""One request's legs across the cluster, driven by `ConductorBackend.generate` (DESIGN section 3).

1. Place it (`ClusterView.place`): a Rejection is a 429 with Retry-After, or a 503 when no instance of a
   needed role is up.
2. RESERVE on the decode instance (a refusal is a 429).
3. PREFILL on the prefill instance (fetching a remote prefix first when placed so); the first token goes out at
   once. Placed inline, DECODE prefills on the decode instance itself.
4. DECODE streams the rest; text and stop strings are handled here (`GenerationState`); a matched stop string
   ends the request and closes the stream, which cancels it on the decode instance.
5. Settle, however the request ended: close the open leg (cancelling it remotely); when the first token
   already ended the request, DECODE still runs (max_tokens 1) so the decode instance commits the blocks the
   prefill wrote there; when a reservation may be held but DECODE was never sent (prefill failed, client gone,
   deadline), UNRESERVE it; then settle the view's queue model and the metrics.

Each leg has its deadline (prefill_timeout_s, first_token_timeout_s, token_timeout_s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from mooncaked.api.backend import GenerationChunk, TokenLogprob
from mooncaked.api.errors import ApiError, deadline_exceeded, internal_error, overloaded, unavailable
from mooncaked.config import Config
from mooncaked.logs import request_id_var
from mooncaked.metrics import Metrics
from mooncaked.model.stopping import FINISH_LENGTH, FINISH_STOP, GenerationState
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.cluster_view import ClusterView
from mooncaked.roles.conductor.frontend import ConductorRequest, ModelFrontend
from mooncaked.roles.worker.messages import (
    DECODE, FINISH_EOS, PREFILL, RESERVE, UNRESERVE, DecodeItem, DecodeRequest, PrefillReply, PrefillRequest,
    ReserveReply, ReserveRequest, SamplingSpec, TokenSample, UnreserveRequest,
)
from mooncaked.rpc import Cancelled, DeadlineExceeded, ResourceExhausted, RpcClient, RpcError, Unavailable
from mooncaked.sched.types import REASON_NO_DECODE, REASON_NO_PREFILL, Placement, Rejection, RequestInfo

logger = logging.getLogger(__name__)

UNRESERVE_TIMEOUT_S = 2.0  # cleanup only: an unclaimed reservation also ends with its lease


_REJECTION_TEXT = {
    "ttft_slo": "predicted time to first token {ttft:.2f} s is over its SLO",
    "tbt_slo": "predicted time between tokens {tbt:.3f} s is over its SLO",
    "decode_full": "every decode instance is full",
    "decode_refused_after_prefill": "the decode instance refused the request",
}


class RunServices(Protocol):
    """What a request's run borrows from the conductor's backend (which owns `num_active`)."""

    config: Config
    model: ModelFrontend
    view: ClusterView
    peers: PeerClients
    metrics: Metrics
    num_active: int

    def update_queue_metrics(self) -> None: ...


class RequestRun:
    """One request's legs. Owns its DECODE stream and `GenerationState` until `chunks()` is closed."""

    def __init__(self, backend: RunServices, prepared: ConductorRequest, state: GenerationState,
                 sampling: SamplingSpec) -> None:
        self.backend = backend
        self.config = backend.config
        self.view = backend.view
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.state = state
        self.sampling = sampling  # max_tokens is the request's; a leg may ask for fewer
        self.placement: Placement | None = None
        self.decode_stream: AsyncIterator[DecodeItem] | None = None
        self.is_decode_owed = False  # the first token ended the request: DECODE still runs, to commit and free
        self.may_hold_reservation = False  # RESERVE was sent and not refused: the decode instance may hold one
        self.is_decode_sent = False  # DECODE went out: the decode instance frees the reservation itself
        self.num_decode_items = 0
        self.num_cached_tokens = 0
        self.first_token_at: float | None = None
        self.status = "cancelled"  # until the request finishes or fails

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        request_id_var.set(self.request_id)
        self.backend.num_active += 1
        try:
            placement = self._place()
            reservation = await self._reserve(placement)
            if placement.prefill_instance:
                first = await self._prefill(placement, reservation)
                yield first
                if first.finish_reason is not None:
                    return
            else:
                self._open_decode(None, self.prepared.max_tokens)
            while True:
                chunk = await self._next_decode_chunk()
                if chunk is not None:
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
        except ApiError as error:
            if self.status != "rejected":
                self.status = "timeout" if error.status == 504 else "failed"
            raise
        except Exception:
            self.status = "failed"
            raise
        finally:
            await self._settle()

    # ---- legs ---------------------------------------------------------------------------------------------
    def _place(self) -> Placement:
        prepared = self.prepared
        info = RequestInfo(self.request_id, prepared.num_prompt_tokens, prepared.block_keys, prepared.arrival_time)
        now = time.monotonic()
        result = self.view.place(info, now)
        if isinstance(result, Rejection):
            raise self._rejected(result)
        self.view.begin(info, result, now)
        self.placement = result
        self.backend.update_queue_metrics()
        logger.debug("placed: prefill %s, decode %s, prefix %d blocks (%d local, fetch %s), predicted TTFT %.3f s",
                     result.prefill_instance or "inline", result.decode_instance, result.num_prefix_blocks,
                     result.num_local_prefix_blocks, result.fetch_from_store, result.predicted_ttft_s)
        return result

    def _rejected(self, rejection: Rejection) -> ApiError:
        self.status = "rejected"
        self.backend.metrics.requests.observe_rejection(rejection.reason)
        logger.info("rejected: %s (predicted TTFT %.3f s, TBT %.3f s)", rejection.reason,
                    rejection.predicted_ttft_s, rejection.predicted_tbt_s)
        if rejection.reason in (REASON_NO_PREFILL, REASON_NO_DECODE):
            role = "prefill" if rejection.reason == REASON_NO_PREFILL else "decode"
            return unavailable(f"No {role} instance is up; retry shortly.")
        text = _REJECTION_TEXT.get(rejection.reason, rejection.reason)
        reason = text.format(ttft=rejection.predicted_ttft_s, tbt=rejection.predicted_tbt_s)
        return overloaded(reason, float(self.config.conductor.retry_after_s))

    async def _reserve(self, placement: Placement) -> ReserveReply:
        prepared, conductor = self.prepared, self.config.conductor
        lease_s = conductor.prefill_timeout_s + self.config.rpc.call_timeout_s
        request = ReserveRequest(self.request_id, list(prepared.block_keys), prepared.num_prompt_tokens,
                                 prepared.max_tokens, min(int(lease_s * 1000), self.config.store.max_lease_ms),
                                 is_inline_prefill=not placement.prefill_instance)
        client = self._client(placement.decode_instance)
        self.may_hold_reservation = True  # from here a cancel or a lost reply may leave one behind
        try:
            reply = await client.call(RESERVE, request, timeout_s=self.config.rpc.call_timeout_s)
        except RpcError as exc:
            raise self._leg_error("reserve", placement.decode_instance, exc) from None
        if not reply.is_accepted:
            self.may_hold_reservation = False
            self.status = "rejected"
            self.backend.metrics.requests.observe_rejection("decode_" + (reply.reason.partition(":")[0] or "refused"))
            logger.info("decode instance %s refused: %s", placement.decode_instance, reply.reason)
            raise overloaded(f"decode instance {placement.decode_instance} refused it: {reply.reason}",
                             float(conductor.retry_after_s))
        return reply

    async def _prefill(self, placement: Placement, reservation: ReserveReply) -> GenerationChunk:
        prepared = self.prepared
        fetch_store = placement.fetch_from_store or ""
        request = PrefillRequest(
            self.request_id, list(prepared.prompt_token_ids), list(prepared.block_keys), self.sampling,
            fetch_store=fetch_store, num_fetch_blocks=placement.num_prefix_blocks if fetch_store else 0,
            decode_store=reservation.store_instance, destinations=list(reservation.destinations))
        client = self._client(placement.prefill_instance)
        try:
            reply = await client.call(PREFILL, request, timeout_s=self.config.conductor.prefill_timeout_s)
        except RpcError as exc:
            raise self._leg_error("prefill", placement.prefill_instance, exc) from None
        self.view.prefill_done(self.request_id)
        self._record_prefill(reply)
        chunk = self._make_chunk([reply.first_token], "")
        assert chunk is not None
        self.is_decode_owed = chunk.finish_reason is not None
        self._open_decode(reply.first_token, 1 if self.is_decode_owed else prepared.max_tokens)
        return chunk

    def _open_decode(self, first_token: TokenSample | None, max_tokens: int) -> None:
        assert self.placement is not None
        prepared, conductor = self.prepared, self.config.conductor
        request = DecodeRequest(self.request_id, list(prepared.prompt_token_ids), list(prepared.block_keys),
                                dataclasses.replace(self.sampling, max_tokens=max_tokens), first_token)
        stream_s = conductor.first_token_timeout_s + max_tokens * conductor.token_timeout_s
        self.decode_stream = self._client(self.placement.decode_instance).stream(DECODE, request, timeout_s=stream_s)
        self.view.decode_started(self.request_id, time.monotonic())
        self.backend.update_queue_metrics()

    async def _next_decode_chunk(self) -> GenerationChunk | None:
        assert self.decode_stream is not None and self.placement is not None
        conductor = self.config.conductor
        timeout_s = conductor.token_timeout_s if self.num_decode_items else conductor.first_token_timeout_s
        self.is_decode_sent = True  # the stream sends its request on the first anext
        try:
            async with asyncio.timeout(timeout_s):
                item = await anext(self.decode_stream)
        except StopAsyncIteration:
            raise internal_error("The decode instance ended the stream without a finish reason.") from None
        except TimeoutError:
            raise deadline_exceeded(f"No token from decode instance {self.placement.decode_instance} "
                                    f"within {timeout_s:g} s.") from None
        except RpcError as exc:
            raise self._leg_error("decode", self.placement.decode_instance, exc) from None
        self.num_decode_items += 1
        if item.num_cached_tokens and not self.placement.prefill_instance:
            self._record_prefix(item.num_cached_tokens, 0)
        return self._make_chunk(item.tokens, item.finish_reason)

    # ---- output -------------------------------------------------------------------------------------------
    def _make_chunk(self, samples: Sequence[TokenSample], decode_finish: str) -> GenerationChunk | None:
        token_ids: list[int] = []
        texts: list[str] = []
        finish_reason: str | None = None
        for sample in samples:
            step = self.state.append(sample.token_id)
            token_ids.append(sample.token_id)
            texts.append(step.text)
            if step.finish_reason is not None:
                finish_reason = step.finish_reason
                break
        if finish_reason is None and decode_finish:
            texts.append(self._flush())
            finish_reason = FINISH_STOP if decode_finish == FINISH_EOS else FINISH_LENGTH
            self.state.finish_reason = finish_reason
        if not token_ids and finish_reason is None:
            return None
        if token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if finish_reason is not None:
            self.status = "ok"
        logprobs = self._logprobs(samples[: len(token_ids)]) if self.prepared.request.num_logprobs is not None \
            else None
        return GenerationChunk(tuple(token_ids), "".join(texts), logprobs, finish_reason,
                               self.prepared.num_prompt_tokens, self.num_cached_tokens)

    def _flush(self) -> str:
        matcher = self.state.matcher
        return matcher.feed(self.state.detokenizer.flush()) + matcher.flush()

    def _logprobs(self, samples: Sequence[TokenSample]) -> tuple[TokenLogprob, ...]:
        decode = self.backend.model.tokenizer.decode
        return tuple(
            TokenLogprob(decode([s.token_id], skip_special_tokens=False), s.logprob,
                         tuple((decode([t], skip_special_tokens=False), lp)
                               for t, lp in zip(s.top_token_ids, s.top_logprobs)))
            for s in samples)

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def _record_prefill(self, reply: PrefillReply) -> None:
        if reply.compute_s > 0:  # the forward alone: queueing on the instance is the queue model's part
            self.view.predictors.add_prefill(self.prepared.num_prompt_tokens, reply.num_cached_tokens,
                                             reply.compute_s)
        self._record_prefix(reply.num_cached_tokens, reply.num_fetched_blocks)

    def _record_prefix(self, num_cached_tokens: int, num_fetched_blocks: int) -> None:
        self.num_cached_tokens = min(num_cached_tokens, self.prepared.num_prompt_tokens)
        num_blocks = len(self.prepared.block_keys)
        num_cached_blocks = min(num_cached_tokens // self.config.kv.block_size, num_blocks)
        num_remote = min(num_fetched_blocks, num_cached_blocks)
        self.view.record_prefix(num_local=num_cached_blocks - num_remote, num_remote=num_remote,
                                num_computed=num_blocks - num_cached_blocks)
        self.backend.metrics.cache.observe_prefix(num_local=num_cached_blocks - num_remote, num_remote=num_remote,
                                                  num_computed=num_blocks - num_cached_blocks)

    def _client(self, instance_name: str) -> RpcClient:
        return self.backend.peers.for_instance(self.view.instance_config(instance_name))

    def _leg_error(self, leg: str, instance: str, exc: RpcError) -> ApiError:
        logger.warning("%s leg on %s failed: %s", leg, instance, exc)
        if isinstance(exc, DeadlineExceeded):
            return deadline_exceeded(f"The {leg} leg on {instance} missed its deadline; retry later.")
        if isinstance(exc, ResourceExhausted):
            return overloaded(f"{instance} is out of capacity: {exc.message}",
                              float(self.config.conductor.retry_after_s))
        if isinstance(exc, (Unavailable, Cancelled)):  # unreachable, or stopping and cancelling its calls
            self.view.report_failure(instance, str(exc))
            return unavailable(f"The {leg} instance {instance} is unreachable; retry shortly.")
        return internal_error(f"The {leg} leg on {instance} failed: {exc.message}")

    async def _settle(self) -> None:
        try:
            if self.decode_stream is not None:
                if self.is_decode_owed:
                    await self._drain_decode()
                await _aclose(self.decode_stream)
            if self.may_hold_reservation and not self.is_decode_sent:
                await self._unreserve()
        finally:
            self.view.finish(self.request_id)
            self.backend.num_active -= 1
            self.backend.update_queue_metrics()
            if self.status != "rejected":
                e2e_s = time.monotonic() - self.prepared.arrival_time
                ttft_s = None if self.first_token_at is None else self.first_token_at - self.prepared.arrival_time
                self.backend.metrics.requests.observe_finished(status=self.status, ttft_s=ttft_s, e2e_s=e2e_s,
                                                               num_output_tokens=len(self.state.output_ids))

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
        assert self.placement is not None
        instance = self.placement.decode_instance
        timeout_s = min(UNRESERVE_TIMEOUT_S, self.config.rpc.call_timeout_s)
        try:
            reply = await self._client(instance).call(UNRESERVE, UnreserveRequest(self.request_id), timeout_s=timeout_s)
        except RpcError as exc:
            logger.warning("unreserve on %s failed (its lease frees it): %s", instance, exc)
            return
        logger.debug("unreserved on %s (was reserved: %s)", instance, reply.was_reserved)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
