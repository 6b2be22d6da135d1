"""RPC messages between the conductor and the prefill and decode instances (docs/design.md section 3).

1. RESERVE (conductor -> decode): the decode instance checks its TBT SLO and memory, sets pages aside, and
   allocates space in its host's store for every prompt block it does not hold; the reply names those
   destinations. With `is_inline_prefill` it only sets pages aside: it will prefill the prompt itself.
   UNRESERVE gives a reservation back when the request ends before DECODE claimed it (failed prefill, client
   gone); otherwise it would be held until its lease runs out.
2. PREFILL (conductor -> prefill): token ids, block keys, an optional remote prefix to fetch first, and the
   decode destinations; the reply carries the first token.
3. DECODE (conductor -> decode, server-streaming): commit the destinations, load the KV into pages, join the
   continuous batch, stream token ids until EOS, a stop token or max_tokens. Stop strings and detokenization
   are the conductor's (it holds the tokenizer); it ends the stream by cancelling the call.
4. LOAD (conductor -> prefill or decode): the instance's load, polled to keep every conductor's view fresh, and
   its own fitted performance model (the conductor predicts with it from its first request); a prefill group's
   first stage also reports the group's pipeline (every stage's model, the handoffs, the chunk size).

Token text never rides these messages; bulk KV bytes go through the store and the transfer engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mooncaked.rpc import Message, Method
from mooncaked.store.messages import WriteHandle

FINISH_EOS = "eos"  # an EOS or stop token id ended the sequence
FINISH_LENGTH = "length"  # max_tokens reached
# starts an Unavailable PREFILL error whose prefix never loaded from its stores: they failed, not the instance
REASON_KV_LOAD_FAILED = "kv_load_failed"


@dataclass(frozen=True)
class TokenBias(Message):
    """One `logit_bias` entry: added to the token's logit before sampling."""

    token_id: int
    bias: float


@dataclass(frozen=True)
class SamplingSpec(Message):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    num_logprobs: Optional[int] = None  # None: no logprobs; 0: the sampled token's only
    num_sampled: int = 0  # output tokens sampled before this leg (a migrated request's seed state)
    priority: int = 0  # lower first within its class (sched/priority.py orders the queues)
    is_batch: bool = False  # the batch class: behind every interactive request in the queues
    # the sampling controls (model/logits_processing.py); penalties and min_tokens read the request's history: the
    # leg's token_ids are the prompt followed by its last num_sampled tokens, the output streamed before this leg
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: list[TokenBias] = field(default_factory=list)
    min_tokens: int = 0  # the request's, counted over its whole output (num_sampled included)
    # constrained decoding: llguidance's grammar text (model/grammar.py grammar_for; "" for none); each instance
    # rebuilds the matcher from the request's output so far (the leg's last num_sampled tokens)
    grammar: str = ""
    # prompt logprobs (echo with logprobs, vLLM's prompt_logprobs): None none; k the k most likely alternatives too;
    # the prompt is then prefilled whole, without reusing a cached prefix
    num_prompt_logprobs: Optional[int] = None
    # parallel sampling (n, best_of): the prompt is prefilled once and this many sequences sample from it, each with
    # its own seed stream (sampling.sequence_params); max_tokens is each sequence's
    num_sequences: int = 1


@dataclass(frozen=True)
class TokenSample(Message):
    token_id: int
    logprob: float = 0.0
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int = 0  # prompt logprobs: the token's rank at its position (1: the most likely); 0 not computed


@dataclass(frozen=True)
class Destination(Message):
    """Where the decode host wants prompt block `block_index` (== num full blocks: the partial tail block)."""

    block_index: int
    handle: WriteHandle


@dataclass(frozen=True)
class StoreTenant(Message):
    """The tenant a request's new blocks belong to in the stores, and its shares of each (kv/tenant_quota.py)."""

    id: str
    pool_share: float = 0.0  # 0: no cap
    min_pool_share: float = 0.0


@dataclass(frozen=True)
class ReserveRequest(Message):
    request_id: str
    block_keys: list[bytes]
    num_prompt_tokens: int
    max_tokens: int
    lease_ms: int
    is_inline_prefill: bool = False  # the decode instance will prefill itself: reserve pages, no store space
    tenant: Optional[StoreTenant] = None
    priority: int = 0  # the order of RESERVE calls waiting for room (sched/priority.py)
    is_batch: bool = False
    # the reserving conductor process's run id (random per start; 0: unknown): a reservation of an earlier run of
    # the same conductor is an orphan once a later run calls, and is dropped
    conductor_run: int = 0
    # the conductor's forecast: seconds from now to the request's decode start (its predicted TTFT, later when the
    # memory forecast defers it), and the output tokens it predicts (0: max_tokens); the decode instance's memory
    # forecast and page deadline use them
    decode_start_s: float = 0.0
    predicted_output_tokens: int = 0
    num_sequences: int = 1  # parallel sampling: pages and batch slots for this many sequences


@dataclass(frozen=True)
class ReserveReply(Message):
    is_accepted: bool
    reason: str = ""
    store_instance: str = ""  # the decode host's store, where the destinations live
    destinations: list[Destination] = field(default_factory=list)
    num_present_blocks: int = 0


@dataclass(frozen=True)
class UnreserveRequest(Message):
    request_id: str


@dataclass(frozen=True)
class UnreserveReply(Message):
    was_reserved: bool


@dataclass(frozen=True)
class PrefillRequest(Message):
    request_id: str
    token_ids: list[int]
    block_keys: list[bytes]
    sampling: SamplingSpec
    fetch_store: str = ""  # a store holding a longer prefix worth fetching first ("" for none)
    num_fetch_blocks: int = 0  # how many prefix blocks to take from fetch_store
    decode_store: str = ""
    destinations: list[Destination] = field(default_factory=list)
    key_isolation: bytes = b""  # the request's isolation tag (kv/keys.py): its keys' namespace
    tenant: Optional[StoreTenant] = None


@dataclass(frozen=True)
class PrefillReply(Message):
    first_token: TokenSample
    num_cached_tokens: int  # prompt tokens whose KV was reused (local or fetched)
    num_fetched_blocks: int  # of those, blocks fetched from another host's store
    prefill_s: float  # from arrival on this instance to the reply (queueing included)
    compute_s: float = 0.0  # the forward of the batch this prompt ran in
    prompt_logprobs: list[TokenSample] = field(default_factory=list)  # the prompt's tokens from the second on
    more_first_tokens: list[TokenSample] = field(default_factory=list)  # sequences 1.. of a parallel sampling
    # with num_fetched_blocks: seconds the prefix took to load (the fetched blocks crossed the link meanwhile)
    fetch_s: float = 0.0


@dataclass(frozen=True)
class DecodeRequest(Message):
    request_id: str
    token_ids: list[int]
    block_keys: list[bytes]
    sampling: SamplingSpec
    first_token: Optional[TokenSample] = None  # None: prefill inline on the decode instance
    key_isolation: bytes = b""  # the request's isolation tag (kv/keys.py): its keys' namespace
    tenant: Optional[StoreTenant] = None
    more_first_tokens: list[TokenSample] = field(default_factory=list)  # sequences 1.. of a parallel sampling


@dataclass(frozen=True)
class DecodeItem(Message):
    tokens: list[TokenSample]
    finish_reason: str = ""  # "" while running, then FINISH_EOS or FINISH_LENGTH
    num_cached_tokens: int = 0  # set on the first item of an inline prefill
    prompt_logprobs: list[TokenSample] = field(default_factory=list)  # an inline prefill's first item, when asked
    sequence: int = 0  # parallel sampling: the sequence the tokens and the finish reason are of


@dataclass(frozen=True)
class LoadRequest(Message):
    conductor_run: int = 0  # a conductor's run id (ReserveRequest.conductor_run); 0: another caller
    device_cache_seq: int = -1  # the last device-cache report the caller applied (-1: none; it needs a dump)


@dataclass(frozen=True)
class LoadReply(Message):
    role: str
    num_running: int  # sequences in the batch (decode) or being prefilled
    num_waiting: int  # queued requests
    num_queued_tokens: int  # prompt tokens waiting for prefill
    num_free_pages: int
    num_pages: int
    step_time_s: float  # recent mean step time (decode) or prefill time (prefill)
    num_context_tokens: int = 0  # decode: total context of the running batch
    prefill_coefficients: list[float] = field(default_factory=list)  # PrefillTimePredictor's; [] until fitted
    decode_coefficients: list[float] = field(default_factory=list)  # DecodeStepPredictor's; [] until fitted
    pending_work_s: float = 0.0  # prefill: predicted seconds of work held (rest of the running batch + queue)
    # prefill: the requests pending_work_s counts; decode: the running batch's and the reservations' (for
    # operators and `bench chaos`: which requests a failure of this instance hits)
    held_request_ids: list[str] = field(default_factory=list)
    overhead_s: float = 0.0  # recent mean seconds a request spends outside queue and compute (decode: inline prefills)
    kv_cache_bytes: int = 0  # bytes of its KV pages (all layers' K and V)
    # a prefill group's member (cluster.prefill_groups) reports its own layers' model here, not in
    # prefill_coefficients (it is no whole-model predictor); a later stage also its mean chunk handoff (the read
    # of one chunk's hidden states from the previous stage)
    stage_coefficients: list[float] = field(default_factory=list)
    chunk_handoff_s: float = 0.0
    # a group's first stage: the pipeline its queue and predictions follow (sched/pipeline.py); [] until every
    # stage has reported a fitted model
    pipeline_stages: list[list[float]] = field(default_factory=list)
    pipeline_handoffs_s: list[float] = field(default_factory=list)
    cpp_chunk_tokens: int = 0
    num_queued_pages: int = 0  # decode: KV pages the reservations waiting for pages need
    num_reserving: int = 0  # decode: RESERVE calls waiting for room (admission none/baseline): its hidden queue
    num_prefilling: int = 0  # decode: of num_waiting, the reservations whose prompts are not prefilled yet
    drain_s: float = 0.0  # decode: predicted seconds until the running sequences end (prefill: pending_work_s)
    # the device prefix cache's keys (kv/device_journal.py): those gained and lost since the request's
    # device_cache_seq, or with is_device_cache_dump all of them (gained); device_cache_seq is the report's
    device_cache_seq: int = 0
    device_keys_gained: list[bytes] = field(default_factory=list)
    device_keys_lost: list[bytes] = field(default_factory=list)
    is_device_cache_dump: bool = False


RESERVE = Method("reserve", ReserveRequest, ReserveReply)
UNRESERVE = Method("unreserve", UnreserveRequest, UnreserveReply)
PREFILL = Method("prefill", PrefillRequest, PrefillReply)
DECODE = Method("decode", DecodeRequest, DecodeItem, is_streaming=True)
LOAD = Method("load", LoadRequest, LoadReply)
