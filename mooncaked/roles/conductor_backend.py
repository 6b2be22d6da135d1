"""The conductor's `GenerationBackend`: one request's life across the cluster (DESIGN section 3).

1. `prepare`: chat template or prompt, tokenization, 413 when the prompt leaves no room in the context,
   max_tokens resolved against the context (vLLM's rules), block keys under the cluster's model namespace.
2. `generate`, an async generator per request (`RequestRun` does the work):
   a. place it (`ClusterView.place`): a Rejection is a 429 with Retry-After, or a 503 when no instance of a
      needed role is up;
   b. RESERVE on the decode instance (a refusal is a 429);
   c. PREFILL on the prefill instance (fetching a remote prefix first when placed so), and the first token goes
      out at once; or, placed inline, DECODE prefills on the decode instance itself;
   d. DECODE streams the rest; text and stop strings are handled here (`GenerationState`); a matched stop
      string ends the request and closes the stream, which cancels it on the decode instance.
3. Each leg has its deadline (prefill_timeout_s, first_token_timeout_s, token_timeout_s). Closing the generator
   (finish, error, client gone) closes the open leg, which cancels it remotely, then settles the view's queue
   model and the metrics. When the first token already ends the request, DECODE still runs (with max_tokens 1)
   so the decode instance commits the blocks the prefill wrote there and frees its reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.api.backend import GenerationChunk, PreparedRequest, TokenLogprob
from mooncaked.api.errors import (
    ApiError, context_too_long, deadline_exceeded, internal_error, invalid_field, overloaded, unavailable,
)
from mooncaked.api.requests import ChatRequest, CompletionRequest
from mooncaked.config import Config
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.logs import request_id_var
from mooncaked.metrics import Metrics
from mooncaked.model.chat_template import ChatTemplate, ChatTemplateError
from mooncaked.model.sampler import SamplingParams
from mooncaked.model.stopping import FINISH_LENGTH, FINISH_STOP, GenerationState
from mooncaked.model.tokenizer import TextTokenizer
from mooncaked.roles.base import PeerClients
from mooncaked.roles.cluster_view import ClusterView
from mooncaked.roles.messages import (
    DECODE, FINISH_EOS, PREFILL, RESERVE, DecodeItem, DecodeRequest, PrefillReply, PrefillRequest, ReserveReply,
    ReserveRequest, SamplingSpec, TokenSample,
)
from mooncaked.rpc import Cancelled, DeadlineExceeded, ResourceExhausted, RpcClient, RpcError, Unavailable
from mooncaked.sched.types import REASON_NO_DECODE, REASON_NO_PREFILL, Placement, Rejection, RequestInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFrontend:
    """What the conductor needs of the model: text in and out, and its limits (no weights)."""

    model_id: str
    served_names: tuple[str, ...]  # the first is the default model of a request
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    context_length: int  # the model's, already capped by model.max_model_len


@dataclass(frozen=True)
class ConductorRequest(PreparedRequest):
    block_keys: tuple[bytes, ...] = ()
    arrival_time: float = 0.0  # time.monotonic()


class ConductorBackend:
    """Serves the HTTP layer. Owns nothing per request beyond each `RequestRun`; borrows the view and clients."""

    def __init__(self, config: Config, model: ModelFrontend, view: ClusterView, peers: PeerClients,
                 metrics: Metrics) -> None:
        self.config = config
        self.model = model
        self.view = view
        self.peers = peers
        self.metrics = metrics
        self.namespace = model_namespace(model.model_id, config.model.dtype, config.kv.block_size)
        self.num_active = 0

    def model_ids(self) -> list[str]:
        return list(self.model.served_names)

    async def prepare(self, request: CompletionRequest | ChatRequest) -> ConductorRequest:
        arrival_time = time.monotonic()
        request_id_var.set(request.request_id)
        try:
            token_ids = self._prompt_ids(request)
            context = self.model.context_length
            if len(token_ids) + 1 > context:
                raise context_too_long(len(token_ids), context)
            max_tokens = self._max_tokens(request, len(token_ids), context)
        except ApiError:
            self.metrics.requests.requests_total.labels(status="invalid").inc()
            raise
        keys = block_keys(token_ids, self.config.kv.block_size, self.namespace)
        return ConductorRequest(request.request_id, request, tuple(token_ids), max_tokens, tuple(keys), arrival_time)

    def _prompt_ids(self, request: CompletionRequest | ChatRequest) -> list[int]:
        tokenizer = self.model.tokenizer
        if isinstance(request, ChatRequest):
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            try:
                text = self.model.chat_template.render(messages, add_generation_prompt=True)
            except ChatTemplateError as exc:
                raise invalid_field("messages", f"the model's chat template rejected them: {exc}") from None
            return tokenizer.encode(text, add_special_tokens=False)
        if isinstance(request.prompt, str):
            return tokenizer.encode(request.prompt, add_special_tokens=True)
        if not request.prompt:
            raise invalid_field("prompt", "the prompt has no tokens")
        bad = [t for t in request.prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise invalid_field("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})")
        return list(request.prompt)

    def _max_tokens(self, request: CompletionRequest | ChatRequest, num_prompt_tokens: int, context: int) -> int:
        room = context - num_prompt_tokens
        requested = request.sampling.max_tokens
        if requested is None:
            return min(room, self.config.conductor.default_max_tokens)
        if requested > room:
            raise invalid_field("max_tokens", f"this model's maximum context length is {context} tokens and the "
                                f"prompt has {num_prompt_tokens}, so max_tokens can be at most {room}; "
                                f"got {requested}")
        return requested

    def generate(self, prepared: PreparedRequest) -> AsyncIterator[GenerationChunk]:
        assert isinstance(prepared, ConductorRequest), "prepare() makes every request this backend generates"
        return RequestRun(self, prepared).chunks()

    async def health(self) -> dict[str, Any]:
        up = {role: sum(1 for w in workers.values() if w.is_up)
              for role, workers in (("prefill", self.view.prefill), ("decode", self.view.decode))}
        is_ok = up["decode"] > 0 and (up["prefill"] > 0 or not self.view.prefill)
        return {"status": "ok" if is_ok else "unavailable", "instances_up": up,
                "stores_up": sum(1 for f in self.view.followers.values() if f.is_up)}

    async def cluster_info(self) -> dict[str, Any]:
        info = await self.view.describe()
        info["active_requests"] = self.num_active
        return info

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def update_queue_metrics(self) -> None:
        prefill_waiting, decode_incoming = self.view.num_waiting()
        self.metrics.queues.set_length("prefill", prefill_waiting)
        self.metrics.queues.set_length("decode", decode_incoming)


def sampling_spec(prepared: ConductorRequest, max_tokens: int) -> SamplingSpec:
    options = prepared.request.sampling
    return SamplingSpec(max_tokens=max_tokens, temperature=options.temperature, top_p=options.top_p,
                        top_k=options.top_k, seed=options.seed, ignore_eos=options.ignore_eos,
                        num_logprobs=prepared.request.num_logprobs)


def generation_state(model: ModelFrontend, prepared: ConductorRequest) -> GenerationState:
    options = prepared.request.sampling
    params = SamplingParams(max_tokens=prepared.max_tokens, temperature=options.temperature, top_k=options.top_k,
                            top_p=options.top_p, seed=options.seed, stop=options.stop,
                            ignore_eos=options.ignore_eos, logprobs=prepared.request.num_logprobs)
    return GenerationState(model.tokenizer, params, prepared.prompt_token_ids, model.eos_token_ids)


_REJECTION_TEXT = {
    "ttft_slo": "predicted time to first token {ttft:.2f} s is over its SLO",
    "tbt_slo": "predicted time between tokens {tbt:.3f} s is over its SLO",
    "decode_full": "every decode instance is full",
    "decode_refused_after_prefill": "the decode instance refused the request",
}


class RequestRun:
    """One request's legs. Owns its DECODE stream and `GenerationState` until `chunks()` is closed."""

    def __init__(self, backend: ConductorBackend, prepared: ConductorRequest) -> None:
        self.backend = backend
        self.config = backend.config
        self.view = backend.view
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.state = generation_state(backend.model, prepared)
        self.placement: Placement | None = None
        self.decode_stream: AsyncIterator[DecodeItem] | None = None
        self.is_decode_owed = False  # the first token ended the request: DECODE still runs, to commit and free
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
        try:
            reply = await client.call(RESERVE, request, timeout_s=self.config.rpc.call_timeout_s)
        except RpcError as exc:
            raise self._leg_error("reserve", placement.decode_instance, exc) from None
        if not reply.is_accepted:
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
            self.request_id, list(prepared.prompt_token_ids), list(prepared.block_keys),
            sampling_spec(prepared, prepared.max_tokens), fetch_store=fetch_store,
            num_fetch_blocks=placement.num_prefix_blocks if fetch_store else 0,
            decode_store=reservation.store_instance, destinations=list(reservation.destinations))
        client = self._client(placement.prefill_instance)
        try:
            reply = await client.call(PREFILL, request, timeout_s=self.config.conductor.prefill_timeout_s)
        except RpcError as exc:
            raise self._leg_error("prefill", placement.prefill_instance, exc) from None
        self.view.prefill_done(self.request_id)
        self._record_prefill(placement, reply)
        chunk = self._make_chunk([reply.first_token], "")
        assert chunk is not None
        self.is_decode_owed = chunk.finish_reason is not None
        self._open_decode(reply.first_token, 1 if self.is_decode_owed else prepared.max_tokens)
        return chunk

    def _open_decode(self, first_token: TokenSample | None, max_tokens: int) -> None:
        assert self.placement is not None
        prepared, conductor = self.prepared, self.config.conductor
        request = DecodeRequest(self.request_id, list(prepared.prompt_token_ids), list(prepared.block_keys),
                                sampling_spec(prepared, max_tokens), first_token)
        stream_s = conductor.first_token_timeout_s + max_tokens * conductor.token_timeout_s
        self.decode_stream = self._client(self.placement.decode_instance).stream(DECODE, request, timeout_s=stream_s)
        self.view.decode_started(self.request_id, time.monotonic())
        self.backend.update_queue_metrics()

    async def _next_decode_chunk(self) -> GenerationChunk | None:
        assert self.decode_stream is not None and self.placement is not None
        conductor = self.config.conductor
        timeout_s = conductor.token_timeout_s if self.num_decode_items else conductor.first_token_timeout_s
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
    def _record_prefill(self, placement: Placement, reply: PrefillReply) -> None:
        if placement.predicted_queue_s == 0.0:  # it ran at once: prefill_s is compute, not queueing
            self.view.predictors.add_prefill(self.prepared.num_prompt_tokens, reply.num_cached_tokens,
                                             reply.prefill_s)
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
        return self.backend.peers.for_instance(self.config.instance_named(instance_name))

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
        try:
            async with asyncio.timeout(self.config.conductor.first_token_timeout_s):
                async for _ in self.decode_stream:
                    pass
        except (RpcError, TimeoutError) as exc:
            logger.warning("the closing decode leg failed: %s", exc)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
