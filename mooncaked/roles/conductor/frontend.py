"""What the conductor knows of the model and of a prepared request, shared by the backend and a request's run.

1. `ModelFrontend` is built once at start from the model's tokenizer, template and shapes (no weights).
2. `prompt_token_ids` turns a request's prompt or chat (a generation's, a context cache's) into token ids, on a
   worker thread (the tokenizer releases the GIL, so the event loop stays free); text far longer than the
   context can hold is refused first, without tokenizing it. `ConductorBackend.prepare` makes a
   `ConductorRequest` per HTTP request (tokens, block keys, arrival time).
3. `sampling_spec` and `generation_state` derive a request's wire sampling spec and its text state from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from mooncaked.api.backend import PreparedRequest
from mooncaked.api.errors import invalid_field, text_too_long
from mooncaked.api.requests import ChatRequest, CompletionRequest
from mooncaked.kv.keys import isolation_tag
from mooncaked.model.chat_template import ChatTemplate, ChatTemplateError
from mooncaked.model.grammar import GrammarTokenizer
from mooncaked.model.reasoning import ReasoningFormat
from mooncaked.model.sampling_params import SamplingParams
from mooncaked.model.stopping import GenerationState
from mooncaked.model.tokenizer import TextTokenizer
from mooncaked.model.tool_formats import HERMES, ToolCallFormat
from mooncaked.roles.worker.messages import SamplingSpec, TokenBias


TEXT_SLACK = 2


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
    kv_geometry: str  # ModelArgs.kv_geometry: part of the block keys' namespace
    grammar_tokenizer: GrammarTokenizer  # llguidance's view of the vocabulary: structured outputs' checks
    tool_format: ToolCallFormat = HERMES  # how the model writes tool calls (model/tool_formats.py)
    tool_marker_ids: Mapping[str, int] = field(default_factory=dict)  # its markers that are one token each
    are_tool_markers_special: bool = False  # some are special tokens: a chat with tools keeps them in its text
    reasoning_format: ReasoningFormat | None = None  # a thinking model's block (model/reasoning.py)
    reasoning_marker_ids: Mapping[str, int] = field(default_factory=dict)  # its markers that are one token each
    are_reasoning_markers_special: bool = False  # its markers are special tokens: a chat keeps them in its text


@dataclass(frozen=True)
class ConductorRequest(PreparedRequest):
    block_keys: tuple[bytes, ...] = ()
    arrival_time: float = 0.0  # time.monotonic()
    key_isolation: bytes = b""  # who may share its KV (kv/keys.py isolation_tag): b"" everyone
    grammar: str = ""  # its output constraint compiled (grammars.py): llguidance's grammar text; "" for none
    reasoning_mode: str = ""  # a thinking model's chat: where its output starts (model/reasoning.py); "" none


async def prompt_token_ids(model: ModelFrontend, request: CompletionRequest | ChatRequest, *,
                           add_generation_prompt: bool) -> list[int]:
    """The token ids of a chat (rendered with the model's template) or of a prompt (text, or ids checked against
    the vocabulary), tokenized on a worker thread; ApiError 400 naming the field at fault, 413 for text far beyond
    the context."""
    check_text_fits(model, request)
    if isinstance(request, CompletionRequest) and not isinstance(request.prompt, str):
        return _token_ids(model, request, add_generation_prompt)
    return await asyncio.to_thread(_token_ids, model, request, add_generation_prompt)


def check_text_fits(model: ModelFrontend, request: CompletionRequest | ChatRequest) -> None:
    """413 for text no tokenization of which fits the context: more characters than TEXT_SLACK times the context
    filled with the vocabulary's longest token (the slack covers tokenizers that drop characters)."""
    if isinstance(request, ChatRequest):
        num_chars, param = sum(len(message.content) for message in request.messages), "messages"
    elif isinstance(request.prompt, str):
        num_chars, param = len(request.prompt), "prompt"
    else:
        return
    max_chars = TEXT_SLACK * model.context_length * model.tokenizer.max_token_chars
    if num_chars > max_chars:
        raise text_too_long(num_chars, max_chars, model.context_length, param)


def _token_ids(model: ModelFrontend, request: CompletionRequest | ChatRequest, add_generation_prompt: bool
               ) -> list[int]:
    if isinstance(request, ChatRequest):
        messages = [m.as_template_dict() for m in request.messages]
        tool_use = request.tool_use
        tools = [tool.as_template_dict() for tool in tool_use.tools] if tool_use.is_enabled else None
        try:
            text = model.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                              **dict(request.template_kwargs))
        except ChatTemplateError as exc:
            raise invalid_field("messages", f"the model's chat template rejected them: {exc}") from None
        return model.tokenizer.encode(text, add_special_tokens=False)
    if isinstance(request.prompt, str):
        return model.tokenizer.encode(request.prompt, add_special_tokens=True)
    bad = [t for t in request.prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise invalid_field("prompt", f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
    return list(request.prompt)


def key_isolation(request: CompletionRequest | ChatRequest) -> bytes:
    """Who may share the request's KV (kv/keys.py): its tenant when the tenant's KV is private, its cache_salt."""
    tenant = request.tenant
    return isolation_tag(tenant=tenant.id if tenant is not None and tenant.is_kv_private else None,
                         cache_salt=request.cache_salt)


def check_sampling_token_ids(model: ModelFrontend, request: CompletionRequest | ChatRequest) -> None:
    """ApiError 400 naming `logit_bias` or `stop_token_ids` when they name a token outside the vocabulary."""
    options = request.sampling
    for name, token_ids in (("logit_bias", [t for t, _ in options.logit_bias]),
                            ("stop_token_ids", list(options.stop_token_ids))):
        bad = [t for t in token_ids if t >= model.vocab_size]
        if bad:
            raise invalid_field(name, f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")


def sampling_spec(prepared: ConductorRequest, max_tokens: int) -> SamplingSpec:
    request, options = prepared.request, prepared.request.sampling
    is_ranked = isinstance(request, CompletionRequest) and request.num_sequences > request.n  # best_of: by logprob
    num_logprobs = 0 if request.num_logprobs is None and is_ranked else request.num_logprobs
    return SamplingSpec(max_tokens=max_tokens, temperature=options.temperature, top_p=options.top_p,
                        top_k=options.top_k, seed=options.seed, stop_token_ids=list(options.stop_token_ids),
                        ignore_eos=options.ignore_eos, num_logprobs=num_logprobs,
                        priority=prepared.request.priority, is_batch=prepared.request.is_batch,
                        presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
                        repetition_penalty=options.repetition_penalty, min_p=options.min_p,
                        logit_bias=[TokenBias(t, b) for t, b in options.logit_bias], min_tokens=options.min_tokens,
                        grammar=prepared.grammar, num_prompt_logprobs=prepared.request.num_prompt_logprobs,
                        num_sequences=prepared.request.num_sequences)


def generation_state(model: ModelFrontend, prepared: ConductorRequest) -> GenerationState:
    options = prepared.request.sampling
    request = prepared.request
    keeps_markers = isinstance(request, ChatRequest) and (  # the parsers read them
        (model.are_tool_markers_special and request.tool_use.is_enabled)
        or (model.are_reasoning_markers_special and prepared.reasoning_mode != ""))
    params = SamplingParams(max_tokens=prepared.max_tokens, temperature=options.temperature, top_k=options.top_k,
                            top_p=options.top_p, seed=options.seed, stop=options.stop,
                            stop_token_ids=options.stop_token_ids, ignore_eos=options.ignore_eos,
                            logprobs=request.num_logprobs, min_tokens=options.min_tokens,
                            include_stop_str_in_output=options.include_stop_str_in_output,
                            skip_special_tokens=options.skip_special_tokens and not keeps_markers)
    return GenerationState(model.tokenizer, params, prepared.prompt_token_ids, model.eos_token_ids)
