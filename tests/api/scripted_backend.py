"""A deterministic `GenerationBackend` for HTTP-layer tests: scripted chunks, scripted failures.

Words in the prompt (or the last chat message) pick the script:
  REJECT -> 429 from prepare; UNAVAILABLE -> 503 from prepare; SLOW_PREPARE -> prepare never returns;
  FAIL_MID -> 503 after two chunks; STALL -> one chunk, then waits forever; BUG -> RuntimeError after one chunk.
Otherwise it yields `max_tokens` chunks of one token each (" t0", " t1", ...), the last with "length"; with n > 1
each choice's in turn.
`reject_every=N` also rejects every N-th prepare with 429 (for load-generator tests on token-id prompts).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from mooncaked.api.backend import GenerationChunk, PreparedRequest, TokenLogprob
from mooncaked.api.errors import ApiError, context_too_long, overloaded, unavailable
from mooncaked.api.requests import ChatRequest, CompletionRequest

MODEL_ID = "tiny-test"


class ScriptedBackend:
    """Owns the record of what happened to each request (`closed`, `cancelled`, `finished` ids)."""

    def __init__(self, *, max_model_len: int = 256, token_delay_s: float = 0.0, reject_every: int = 0) -> None:
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.reject_every = reject_every
        self.num_prepared = 0
        self.cancelled: set[str] = set()
        self.closed: set[str] = set()
        self.finished: set[str] = set()
        self.closed_event = asyncio.Event()

    def model_ids(self) -> list[str]:
        return [MODEL_ID]

    async def prepare(self, request: CompletionRequest | ChatRequest) -> PreparedRequest:
        self.num_prepared += 1
        text = _prompt_text(request)
        if "REJECT" in text or (self.reject_every and self.num_prepared % self.reject_every == 0):
            raise overloaded("predicted TTFT over its SLO", retry_after_s=1.5)
        if "UNAVAILABLE" in text:
            raise unavailable("No decode instance is up.")
        if "SLOW_PREPARE" in text:
            await asyncio.sleep(3600)
        if isinstance(request, CompletionRequest) and isinstance(request.prompt, tuple):
            token_ids = request.prompt
        else:
            token_ids = tuple(text.encode("utf-8"))
        if len(token_ids) >= self.max_model_len:
            raise context_too_long(len(token_ids), self.max_model_len)
        max_tokens = request.sampling.max_tokens or self.max_model_len - len(token_ids)
        return PreparedRequest(request.request_id, request, token_ids, max_tokens)

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[GenerationChunk]:
        request_id = prepared.request_id
        text = _prompt_text(prepared.request)
        try:
            for index in range(prepared.max_tokens):
                if index == 2 and "FAIL_MID" in text:
                    raise unavailable("The decode instance went away.")
                if index == 1 and "STALL" in text:
                    await asyncio.sleep(3600)
                if index == 1 and "BUG" in text:
                    raise RuntimeError("scripted bug")
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                for choice in range(prepared.request.n):  # n > 1: every choice's token in turn
                    chunk = dataclasses.replace(_chunk(prepared, index, self.token_delay_s), index=choice)
                    if chunk.finish_reason is not None and choice == prepared.request.n - 1:
                        self.finished.add(request_id)
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            if request_id not in self.finished:
                self.cancelled.add(request_id)
            raise
        finally:
            self.closed.add(request_id)
            self.closed_event.set()

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "models": self.model_ids()}

    async def cluster_info(self) -> dict[str, Any]:
        return {"instances": [{"role": "decode", "address": "scripted"}], "num_prepared": self.num_prepared}

    def metrics_text(self) -> bytes:
        return f"mooncaked_scripted_prepared_total {self.num_prepared}\n".encode()


def _chunk(prepared: PreparedRequest, index: int, token_delay_s: float) -> GenerationChunk:
    """Token `index`; the first carries predictions of one token delay each (as the conductor's would)."""
    is_last = index == prepared.max_tokens - 1
    num_logprobs = prepared.request.num_logprobs
    logprobs = None
    if num_logprobs is not None:
        top = tuple((f" a{k}", -0.5 * (k + 1)) for k in range(num_logprobs))
        logprobs = (TokenLogprob(token=f" t{index}", logprob=-0.25, top_logprobs=top),)
    return GenerationChunk(
        token_ids=(100 + index,),
        text=f" t{index}",
        logprobs=logprobs,
        finish_reason="length" if is_last else None,
        num_prompt_tokens=prepared.num_prompt_tokens,
        num_cached_tokens=prepared.num_prompt_tokens // 2,
        predicted_ttft_s=token_delay_s if index == 0 else None,
        predicted_tbt_s=token_delay_s if index == 0 else None,
    )


def _prompt_text(request: CompletionRequest | ChatRequest | Any) -> str:
    if isinstance(request, ChatRequest):
        return request.messages[-1].content
    return request.prompt if isinstance(request.prompt, str) else ""
