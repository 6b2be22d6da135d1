"""One prompt on a later stage of a prefill group (stage.StageService runs it).

1. check_request refuses a CPP_STAGE request this stage cannot serve (another group, stage or layers, a chunk size
   or length out of range, blocks that do not match the prompt, an unknown store), before anything is allocated.
2. open_job rebuilds the last stage's grammar state (from the request's token ids), allocates the prompt's pages
   (this stage's layers) and splits its new tokens into chunks; the service
   then adds the chunk sender and starts loading the reused prefix.
3. While the prompt runs, the compute thread stores each layer of the last chunk through store_layer; fail records
   the first error and stops the job (nothing more is computed, sent or stored).
"""

from __future__ import annotations

import asyncio
from collections.abc import Container
from dataclasses import dataclass, field

from mooncaked.config.prefill_groups import GroupStage
from mooncaked.engine.batch import PrefillSeq, split_prefill_chunks
from mooncaked.roles.worker.group.forward import ChunkSender
from mooncaked.roles.worker.group.messages import StageRequest
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.model.grammar import GrammarState
from mooncaked.model.sampling_params import SamplingParams
from mooncaked.roles.worker.messages import SamplingSpec, TokenSample
from mooncaked.roles.worker.sampling import history_of, to_params
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import Internal, InvalidArgument, ResourceExhausted


class StageFailed(Internal):
    """The prompt failed on this stage; the message (sent to the first stage) says why."""


@dataclass
class StageJob:
    """One prompt on this stage; owned by the StageService while its CPP_STAGE call runs."""

    request: StageRequest
    kv: RequestKv
    chunks: list[PrefillSeq]
    deadline: float  # time.monotonic()
    sender: ChunkSender | None = None
    is_cancelled: bool = False  # set on the event loop; the compute thread then sends and stores nothing more
    error: Exception | None = None
    num_received: int = 0
    num_computed: int = 0
    first_token: TokenSample | None = None
    compute_s: float = 0.0
    grammar: GrammarState | None = None  # the last stage's constrained decoding of the first token
    computed: asyncio.Event = field(default_factory=asyncio.Event)  # the last chunk ran, or the job failed
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while the compute thread is not in it

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def store_layer(self, layer: int) -> None:
        """Compute thread, after layer `layer` of the last chunk (prefill.forward.ForwardPlan)."""
        writes = [write for write in self.request.writes if write.block_indices]
        if writes and not self.is_cancelled:
            self.kv.store_layer(layer, writes)

    def fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self.is_cancelled = True
        self.computed.set()


def num_prefix_tokens(worker: Worker, request: StageRequest) -> int:
    return request.num_prefix_blocks * worker.block_size


def check_request(worker: Worker, stage: GroupStage, request: StageRequest, open_ids: Container[str]) -> None:
    """Raises InvalidArgument naming what of `request` this stage cannot serve; `open_ids`: its open prompts."""
    layers = stage.layers
    if (request.group, request.stage) != (stage.group.name, stage.index) or \
            (request.first_layer, request.end_layer) != (layers.start, layers.end):
        raise InvalidArgument(f"{worker.instance.name} is {stage.describe()}, not stage {request.stage} of "
                              f"{request.group!r} with layers {request.first_layer}..{request.end_layer - 1}; "
                              "the members' cluster.prefill_groups must agree")
    if not 1 <= request.chunk_tokens <= worker.section.cpp_chunk_tokens:
        raise InvalidArgument(f"chunk_tokens {request.chunk_tokens} is not within 1..{worker.section.cpp_chunk_tokens}"
                              " (worker.cpp_chunk_tokens must agree across the group)")
    if not 1 <= request.num_tokens <= worker.config.model.max_model_len:
        raise InvalidArgument(f"num_tokens {request.num_tokens} is not within 1..model.max_model_len")
    if not 0 <= request.num_prefix_blocks * worker.block_size < request.num_tokens:
        raise InvalidArgument("num_prefix_blocks must leave at least one token to compute")
    if request.request_id in open_ids:
        raise InvalidArgument(f"prompt {request.request_id!r} is already open on this stage")
    num_blocks = -(-request.num_tokens // worker.block_size)
    for span in (*request.sources, *request.writes):
        if len(span.block_indices) != len(span.offsets) or any(not 0 <= i < num_blocks
                                                                for i in span.block_indices):
            raise InvalidArgument(f"blocks of store {span.store_name!r} do not match the prompt's {num_blocks}")
        worker.stores.instance_of(span.store_name)
    if any(i >= request.num_prefix_blocks for s in request.sources for i in s.block_indices):
        raise InvalidArgument("sources name blocks beyond the reused prefix")
    params = to_params(request.sampling, worker.vocab_size)
    if stage.is_last and reads_history(request.sampling, params):
        if len(request.token_ids) != request.num_tokens:
            raise InvalidArgument(f"the last stage samples with penalties, min_tokens or a grammar: it needs the "
                                  f"prompt's {request.num_tokens} token ids, got {len(request.token_ids)}")
        history_of(request.token_ids, params, request.sampling.num_sampled)


def reads_history(spec: SamplingSpec, params: SamplingParams) -> bool:
    """Whether sampling the first token reads the prompt's token ids (StageRequest.token_ids)."""
    return params.needs_history or bool(spec.grammar)


def open_job(worker: Worker, request: StageRequest, deadline: float) -> StageJob:
    """A job for a checked request: its pages allocated, its new tokens split into chunks, idle."""
    assert worker.grammar is not None
    grammar = worker.grammar.state_for(request.sampling, request.token_ids) if request.token_ids else None
    try:
        kv = RequestKv(worker, request.request_id, request.num_tokens)
    except RuntimeError as exc:
        raise ResourceExhausted(f"not enough KV pages for {request.num_tokens} tokens: {exc}") from None
    num_cached_tokens = num_prefix_tokens(worker, request)
    seq = PrefillSeq([0] * (request.num_tokens - num_cached_tokens), num_cached_tokens, kv.page_ids)
    job = StageJob(request, kv, split_prefill_chunks(seq, request.chunk_tokens), deadline)
    job.grammar = grammar
    job.idle.set()
    return job
