"""The contract between the HTTP layer and whatever generates tokens (the conductor).

A request's life through a backend, as the app drives it:
1. `prepare(request)`: chat template, tokenization, limits; may raise `ApiError` (400, 413 prompt beyond the
   context, 429 early rejection with `retry_after_s`, 503 no instance up).
2. `generate(prepared)`: an async iterator of `GenerationChunk`s; the last one has `finish_reason` set. It may
   raise `ApiError` (429, 503, 504) before the first chunk or mid-stream.
3. The app always closes the iterator when it stops reading (`aclose()` when it has one): on finish, on
   error, and when the client disconnects, so the backend must release the request's resources (pages,
   leases, remote legs) on `GeneratorExit` / `CancelledError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from mooncaked.api.requests import ChatRequest, CompletionRequest

FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls"})


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to generate. Backends may subclass it (frozen) to carry their own fields."""

    request_id: str
    request: CompletionRequest | ChatRequest
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # resolved against the context: at least 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives at its position."""

    token: str
    logprob: float
    top_logprobs: tuple[tuple[str, float], ...] = ()  # (token, logprob), most likely first


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log-probability given the tokens before it (None for the first) and the most likely
    alternatives at its position."""

    token_id: int
    token: str
    logprob: float | None
    rank: int | None = None  # 1: the most likely token there
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, token, logprob), most likely first


@dataclass(frozen=True)
class ToolCallOut:
    """A tool call the model made, whole (OpenAI's streaming lets arguments come in one piece)."""

    index: int  # its place among the answer's calls
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one request; several tokens per chunk when the decode step batches them."""

    token_ids: tuple[int, ...]
    text: str  # the text delta these tokens add (stop strings already removed)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token when logprobs were asked for
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "tool_calls"; on the last chunk only
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the cache
    predicted_ttft_s: float | None = None  # first chunk: the scheduler's predictions at placement
    predicted_tbt_s: float | None = None
    tool_calls: tuple[ToolCallOut, ...] = ()  # calls completed by this chunk (chat with tools); `text` is content
    reasoning: str = ""  # a thinking model's reasoning text of this chunk (chat); `text` is the answer's
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # the first chunk, when the request asked for them
    echo_text: str = ""  # the first chunk of a completion with echo: the prompt's text
    index: int = 0  # the choice it belongs to (a request of several prompts, or n > 1)

    def prediction_headers(self) -> dict[str, str]:
        """X-Mooncaked-Predicted-TTFT-Ms / -TBT-Ms for a response that starts with this chunk (benchmarks read them)."""
        headers = {}
        if self.predicted_ttft_s is not None:
            headers["X-Mooncaked-Predicted-TTFT-Ms"] = f"{self.predicted_ttft_s * 1000:.3f}"
        if self.predicted_tbt_s is not None:
            headers["X-Mooncaked-Predicted-TBT-Ms"] = f"{self.predicted_tbt_s * 1000:.3f}"
        return headers

    def __post_init__(self) -> None:
        assert self.finish_reason is None or self.finish_reason in FINISH_REASONS, self.finish_reason


class GenerationBackend(Protocol):
    def model_ids(self) -> list[str]:
        """The served model ids; the first is the default when a request names none."""
        ...

    async def prepare(self, request: CompletionRequest | ChatRequest) -> PreparedRequest:
        ...

    def generate(self, prepared: PreparedRequest) -> AsyncIterator[GenerationChunk]:
        ...

    async def health(self) -> dict[str, Any]:
        """JSON-able health; `{"status": "ok", ...}` answers 200, any other status answers 503."""
        ...

    async def cluster_info(self) -> dict[str, Any]:
        """JSON-able view of instances, loads and cache statistics for GET /v1/cluster."""
        ...

    def metrics_text(self) -> bytes:
        """Prometheus text exposition for GET /metrics."""
        ...
