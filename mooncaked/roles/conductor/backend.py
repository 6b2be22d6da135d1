"""The conductor's `GenerationBackend`: requests in, generated chunks out (docs/design.md section 3).

1. `prepare`: chat template or prompt, tokenization, 413 when the prompt leaves no room in the context,
   max_tokens resolved against the context (vLLM's rules), the output constraint (or a required tool call's
   grammar) compiled (grammars.py, tool_output.py), block keys under the cluster's model namespace.
2. `generate`: a `RequestRun` (request_run.py) per request places it and drives its legs; closing the
   iterator (finish, error, client gone) cancels the open leg and frees what the request held. A chat with
   tools has its text split into content and tool calls on the way out (tool_output.py).
3. `health`, `cluster_info` and `metrics_text` answer the HTTP layer from the cluster view and the metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from mooncaked.api.backend import GenerationChunk, PreparedRequest
from mooncaked.api.errors import ApiError, context_too_long, invalid_field
from mooncaked.api.requests import ChatRequest, CompletionRequest
from mooncaked.api.structured import OutputConstraint
from mooncaked.config import Config
from mooncaked.kv.cache_dtype import namespace_dtype
from mooncaked.kv.keys import block_keys, isolated_namespace, model_namespace
from mooncaked.model.reasoning import CLOSED, reasoning_lark, reasoning_mode
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.best_of import with_best_of
from mooncaked.roles.conductor.class_metrics import ClassMetrics
from mooncaked.roles.conductor.echo_output import with_echo
from mooncaked.roles.conductor.frontend import (ConductorRequest, ModelFrontend, check_sampling_token_ids,
                                                generation_state, key_isolation, prompt_token_ids, sampling_spec)
from mooncaked.roles.conductor.grammars import GrammarCache
from mooncaked.roles.conductor.leader import PdController
from mooncaked.roles.conductor.reasoning_output import with_reasoning
from mooncaked.roles.conductor.request_run import RequestRun
from mooncaked.roles.conductor.tool_output import tool_grammar, with_tool_calls
from mooncaked.roles.conductor.view.cluster import ClusterView
from mooncaked.roles.conductor.view.cluster_info import describe_cluster
from mooncaked.roles.conductor.view.prediction_errors import PredictionErrors
from mooncaked.runtime.logs import request_id_var
from mooncaked.runtime.metrics import Metrics
from mooncaked.sched.types import REASON_NO_DECODE, REASON_NO_PREFILL


PROMPT_TAIL_TOKENS = 32  # the prompt's end a thinking model's template may open or close its block in


class ConductorBackend:
    """Serves the HTTP layer. Owns the prediction-error records and nothing per request beyond each `RequestRun`;
    borrows the view and clients."""

    def __init__(self, config: Config, model: ModelFrontend, view: ClusterView, peers: PeerClients,
                 metrics: Metrics, controller: PdController | None = None) -> None:
        self.config = config
        self.controller = controller
        self.model = model
        self.view = view
        self.peers = peers
        self.metrics = metrics
        self.namespace = model_namespace(model.model_id, namespace_dtype(config.model.dtype, config.kv.cache_dtype),
                                         config.kv.block_size, model.kv_geometry)
        self.num_active = 0
        self.prediction_errors = PredictionErrors(metrics.predictions)
        self.grammars = GrammarCache(model.grammar_tokenizer)
        self.class_metrics = ClassMetrics(metrics)
        self.on_interactive_rejection: Callable[[], None] = lambda: None  # set by the batch manager: yield

    def model_ids(self) -> list[str]:
        return list(self.model.served_names)

    async def prepare(self, request: CompletionRequest | ChatRequest) -> ConductorRequest:
        arrival_time = time.monotonic()
        request_id_var.set(request.request_id)
        try:
            token_ids = await prompt_token_ids(self.model, request, add_generation_prompt=True)
            if not token_ids:  # only a prompt of no token ids: text and chats always have some
                raise invalid_field("prompt", "the prompt has no tokens")
            context = self.model.context_length
            if len(token_ids) + 1 > context:
                raise context_too_long(len(token_ids), context)
            max_tokens = self._max_tokens(request, len(token_ids), context)
            check_sampling_token_ids(self.model, request)
            mode = self._reasoning_mode(request, token_ids)
            grammar = self._grammar(request, mode)
        except ApiError:
            self.metrics.requests.requests_total.labels(status="invalid").inc()
            raise
        isolation = key_isolation(request)
        keys = block_keys(token_ids, self.config.kv.block_size, isolated_namespace(self.namespace, isolation))
        return ConductorRequest(request.request_id, request, tuple(token_ids), max_tokens, tuple(keys), arrival_time,
                                isolation, grammar, mode)

    def _reasoning_mode(self, request: CompletionRequest | ChatRequest, token_ids: list[int]) -> str:
        """Where a thinking model's chat answer starts (model/reasoning.py), read off the prompt's end; "" else."""
        fmt = self.model.reasoning_format
        if fmt is None or not isinstance(request, ChatRequest):
            return ""
        tail = self.model.tokenizer.decode(token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        mode = reasoning_mode(tail, fmt)
        return "" if mode == CLOSED else mode

    def _grammar(self, request: CompletionRequest | ChatRequest, reasoning: str) -> str:
        """The compiled grammar the answer follows: its output constraint's, or its forced tool calls' ("" none);
        a thinking model reasons freely before it."""
        fmt = self.model.reasoning_format
        prefix = reasoning_lark(fmt, reasoning, self.model.reasoning_marker_ids) if fmt and reasoning else ""
        if request.constraint is not None:
            return self.grammars.grammar_text(request.constraint, prefix)
        if isinstance(request, ChatRequest) and request.tool_use.is_enabled and request.tool_use.is_forced:
            lark = tool_grammar(self.model, request.tool_use)
            return self.grammars.grammar_text(OutputConstraint("grammar", lark, "tools"), prefix)
        return ""

    def _max_tokens(self, request: CompletionRequest | ChatRequest, num_prompt_tokens: int, context: int) -> int:
        room = context - num_prompt_tokens
        requested = request.sampling.max_tokens
        if requested == 0:  # echo only: the prefill samples one token anyway (with_echo leaves it out)
            return 1
        if requested is None:
            max_tokens = min(room, self.config.conductor.default_max_tokens)
            if request.sampling.min_tokens > max_tokens:
                raise invalid_field("min_tokens", f"min_tokens ({request.sampling.min_tokens}) is more than the "
                                    f"{max_tokens} tokens this request may generate; set max_tokens")
            return max_tokens
        if requested > room:
            raise invalid_field("max_tokens", f"this model's maximum context length is {context} tokens and the "
                                f"prompt has {num_prompt_tokens}, so max_tokens can be at most {room}; "
                                f"got {requested}")
        return requested

    def generate(self, prepared: PreparedRequest) -> AsyncIterator[GenerationChunk]:
        assert isinstance(prepared, ConductorRequest), "prepare() makes every request this backend generates"
        spec = sampling_spec(prepared, prepared.max_tokens)
        states = [generation_state(self.model, prepared) for _ in range(spec.num_sequences)]
        chunks = RequestRun(self, prepared, states, spec).chunks()
        request = prepared.request
        if isinstance(request, CompletionRequest):
            if request.num_sequences > request.n:
                chunks = with_best_of(chunks, request.n)
            if not request.echo and request.sampling.max_tokens != 0:
                return chunks
            text = request.prompt if isinstance(request.prompt, str) else self.model.tokenizer.decode(
                list(request.prompt), skip_special_tokens=False)
            return with_echo(chunks, text if request.echo else "", request.sampling.max_tokens == 0, request.n)
        if prepared.reasoning_mode and self.model.reasoning_format is not None:
            chunks = with_reasoning(chunks, self.model.reasoning_format, prepared.reasoning_mode)
        if request.tool_use.is_enabled:
            chunks = with_tool_calls(chunks, self.model)
        return chunks

    async def health(self) -> dict[str, Any]:
        """Status, counts of instances up, and per instance: up or not, outages in the last
        outages.WINDOW_S, the last error; `crash_looping` names those down CRASH_LOOP_OUTAGES times in it."""
        up = {role: sum(1 for w in workers.values() if w.is_up)
              for role, workers in (("prefill", self.view.prefill), ("decode", self.view.decode))}
        is_ok = up["decode"] > 0 and (up["prefill"] > 0 or not self.view.prefill)
        now = time.monotonic()
        states = [(w.instance, w.is_up, w.outages, w.last_error) for w in self.view.workers]
        states += [(f.store, f.is_up, f.outages, f.last_error) for f in self.view.followers.values()]
        instances = {instance.name: {"role": instance.role, "is_up": is_up, "recent_outages": outages.num_recent(now),
                                     "last_error": last_error} for instance, is_up, outages, last_error in states}
        looping = sorted(instance.name for instance, _, outages, _ in states if outages.is_crash_looping(now))
        return {"status": "ok" if is_ok else "unavailable", "instances_up": up,
                "stores_up": sum(1 for f in self.view.followers.values() if f.is_up),
                "membership": self.view.membership.status().as_dict(),
                "leader": None if self.controller is None else self.controller.membership.leader(),
                "instances": instances, "crash_looping": looping}

    async def cluster_info(self) -> dict[str, Any]:
        info = await describe_cluster(self.view)
        info["active_requests"] = self.num_active
        info["predictions"] = self.prediction_errors.describe()
        if self.controller is not None:
            info["controller"] = self.controller.describe()
        return info

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def interactive_rejected(self, reason: str) -> None:
        """An interactive request was turned away: for load, batch lines yield (not for a missing instance)."""
        if reason not in (REASON_NO_PREFILL, REASON_NO_DECODE):
            self.on_interactive_rejection()

    def update_queue_metrics(self) -> None:
        prefill_waiting, decode_incoming = self.view.num_waiting()
        self.metrics.queues.set_length("prefill", prefill_waiting)
        self.metrics.queues.set_length("decode", decode_incoming)
