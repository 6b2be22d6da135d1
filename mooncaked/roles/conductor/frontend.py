"""What the conductor knows of the model and of a prepared request, shared by the backend and a request's run.

1. `ModelFrontend` is built once at start from the model's tokenizer, template and shapes (no weights).
2. `prompt_token_ids` turns a request's prompt or chat (a generation's, a context cache's) into token ids;
   `ConductorBackend.prepare` makes a `ConductorRequest` per HTTP request (tokens, block keys, arrival time).
3. `sampling_spec` and `generation_state` derive a request's wire sampling spec and its text state from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.api.backend import PreparedRequest
from mooncaked.api.errors import invalid_field
from mooncaked.api.requests import ChatRequest, CompletionRequest
from mooncaked.kv.keys import isolation_tag
from mooncaked.model.chat_template import ChatTemplate, ChatTemplateError
from mooncaked.model.sampler import SamplingParams
from mooncaked.model.stopping import GenerationState
from mooncaked.model.tokenizer import TextTokenizer
from mooncaked.roles.worker.messages import SamplingSpec


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


@dataclass(frozen=True)
class ConductorRequest(PreparedRequest):
    block_keys: tuple[bytes, ...] = ()
    arrival_time: float = 0.0  # time.monotonic()
    key_isolation: bytes = b""  # who may share its KV (kv/keys.py isolation_tag): b"" everyone


def prompt_token_ids(model: ModelFrontend, request: CompletionRequest | ChatRequest, *,
                     add_generation_prompt: bool) -> list[int]:
    """The token ids of a chat (rendered with the model's template) or of a prompt (text, or ids checked against
    the vocabulary); ApiError 400 naming the field at fault."""
    if isinstance(request, ChatRequest):
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            text = model.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
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


def sampling_spec(prepared: ConductorRequest, max_tokens: int) -> SamplingSpec:
    options = prepared.request.sampling
    return SamplingSpec(max_tokens=max_tokens, temperature=options.temperature, top_p=options.top_p,
                        top_k=options.top_k, seed=options.seed, ignore_eos=options.ignore_eos,
                        num_logprobs=prepared.request.num_logprobs, priority=prepared.request.priority,
                        is_batch=prepared.request.is_batch)


def generation_state(model: ModelFrontend, prepared: ConductorRequest) -> GenerationState:
    options = prepared.request.sampling
    params = SamplingParams(max_tokens=prepared.max_tokens, temperature=options.temperature, top_k=options.top_k,
                            top_p=options.top_p, seed=options.seed, stop=options.stop,
                            ignore_eos=options.ignore_eos, logprobs=prepared.request.num_logprobs)
    return GenerationState(model.tokenizer, params, prepared.prompt_token_ids, model.eos_token_ids)
