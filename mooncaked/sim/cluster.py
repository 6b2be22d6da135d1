"""Simulated cluster state: host stores, prefill instances, decode instances (each owns its own fields).

The engine (`mooncaked.sim.engine`) is the only writer; these classes keep the bookkeeping that makes the
scheduler's views cheap to build (running sums instead of rescans). A prefill group (chunked pipeline
parallelism) is one `PrefillInstance` with a `pipeline`, as the conductor sees it: one candidate named after its
first stage, with one queue and its first stage's host store (the group's store).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncaked.kv.block_cache import BlockCache
from mooncaked.kv.eviction import make_eviction_policy
from mooncaked.kv.replica_eviction import make_spare_first_policy
from mooncaked.sched.decode_admission import DecodeLoadNow
from mooncaked.sched.decode_memory import DecodeHold
from mooncaked.sched.pipeline import even_pipeline
from mooncaked.sched.replicas import StoreMarks
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import DecodeInstanceView, PipelineSpec, Placement, PrefillInstanceView
from mooncaked.sim.config import SimConfig
from mooncaked.sim.costs import CostModel
from mooncaked.sim.device_tier import DeviceTier


class HostStore:
    """One host's DRAM block cache; every change is published to the shadow index as a sequenced event.

    Also counts its evictions, and among them the sole-copy evictions: blocks no other store held any more.
    With `is_replica_aware`, its eviction gives spare copies back first (`apply_marks`).
    """

    def __init__(self, store_id: str, capacity_blocks: int, eviction: str, index: ShadowIndex,
                 is_replica_aware: bool = False) -> None:
        self.store_id = store_id
        self.spare_policy = make_spare_first_policy(eviction) if is_replica_aware else None
        policy = make_eviction_policy(eviction) if self.spare_policy is None else self.spare_policy
        self.cache = BlockCache(policy, capacity_blocks)
        self._index = index
        self._seq = 0
        self.nic_free_at = 0.0
        self.num_evicted = 0
        self.num_sole_copy_evictions = 0
        index.apply_dump(store_id, 0, [])

    def put(self, keys: Sequence[Hashable], now: float, start: int = 0) -> int:
        """Commits keys[start:] (touching resident ones); returns how many new blocks became resident."""
        result = self.cache.insert(keys, now, start)
        if result.evicted:
            self._seq += 1
            self._index.apply_removed(self.store_id, self._seq, result.evicted)
            self.num_evicted += len(result.evicted)
            self.num_sole_copy_evictions += sum(1 for key in result.evicted if not self._index.has_key(key))
        if result.inserted:
            self._seq += 1
            self._index.apply_stored(self.store_id, self._seq, result.inserted)
        return len(result.inserted)

    def apply_marks(self, marks: StoreMarks) -> None:
        assert self.spare_policy is not None, "spare marks for a store without replica-aware eviction"
        for key in marks.spare:
            self.spare_policy.mark_spare(key, True)
        for key in marks.kept:
            self.spare_policy.mark_spare(key, False)


@dataclass
class PrefillJob:
    """One placed prefill; `num_new_tokens`, `enqueued_at`, `is_batch` and `priority` are what
    `sched.prefill_batch.take_batch` reads."""

    request_index: int
    placement: Placement
    keys: tuple[int, ...]
    num_prompt_tokens: int
    fetch_done_at: float
    is_fetch_pending: bool
    num_new_tokens: int = 0  # the prompt less the prefix reused at placement
    enqueued_at: float = 0.0
    is_batch: bool = False  # the trace has no Batch API lines
    priority: int = 0
    started_at: float = 0.0
    compute_s: float = 0.0
    locked_keys: list[Hashable] = field(default_factory=list)


@dataclass
class PrefillInstance:
    instance_id: str
    store: HostStore
    queue: deque[PrefillJob] = field(default_factory=deque)
    running: list[PrefillJob] = field(default_factory=list)  # the forward under way (sched.prefill_batch)
    busy_until: float = 0.0
    queued_prefill_s: float = 0.0
    busy_time_done: float = 0.0  # seconds of finished jobs (fetch waits included)
    pipeline: PipelineSpec | None = None  # a prefill group: its stages' models, chunk size and handoffs
    device: DeviceTier | None = None  # its device prefix cache (cluster.device_prefix_blocks; not for groups)

    @property
    def num_nodes(self) -> int:
        return 1 if self.pipeline is None else len(self.pipeline.stage_coefficients)

    def busy_time(self, now: float) -> float:
        if not self.running:
            return self.busy_time_done
        return self.busy_time_done + max(0.0, min(now, self.busy_until) - self.running[0].started_at)

    def view(self, coldest_use: float = 0.0) -> PrefillInstanceView:
        return PrefillInstanceView(
            self.instance_id, self.store.store_id, self.busy_until, self.queued_prefill_s, len(self.queue),
            coldest_use=coldest_use, pipeline=self.pipeline,
            device_id=self.instance_id if self.device is not None else "",
        )


def prefill_instances(num_prefill: int, num_groups: int, pipeline: PipelineSpec | None,
                      make_store: Callable[[int], HostStore]) -> list[PrefillInstance]:
    """Prefill nodes 0..num_prefill-1: the last `num_groups` x stages form the groups, in order, the others are
    single instances. A group's later stages keep no store: the conductor places nothing on them, so their
    hosts' DRAM would hold no prefix. `make_store(node)` gives node's host store."""
    num_stages = 0 if pipeline is None or num_groups == 0 else len(pipeline.stage_coefficients)
    num_single = num_prefill - num_groups * num_stages
    assert num_single >= 0, "more group nodes than prefill nodes"
    instances = [PrefillInstance(f"prefill-{i}", make_store(i)) for i in range(num_single)]
    for first in range(num_single, num_prefill, max(num_stages, 1)):
        instances.append(PrefillInstance(f"prefill-{first}", make_store(first), pipeline=pipeline))
    return instances


@dataclass
class DecodeSeq:
    request_index: int
    context_tokens: int
    num_tokens_left: int
    last_token_at: float
    started_at: float = 0.0
    gaps: list[float] = field(default_factory=list)
    is_past_handoff: bool = False  # the first gap (prefill's first token -> first decode token) is behind
    ready_at: float = 0.0  # its KV is loaded: from then on a wait for pages or a batch slot counts as a gap
    # its decode start was deferred (sched/admission.py): the conductor holds its first token until it joins the
    # batch, so that wait counts in its TTFT instead of as a gap
    is_first_token_held: bool = False


@dataclass
class DecodeInstance:
    """`reserved_pages`: the KV pages each placed request holds from RESERVE to its end (prompt and output, as
    the decode role reserves them); `inline`: prefills waiting for the next step, (request index, compute s);
    each step runs the ones waiting at its start before its decode."""

    instance_id: str
    store: HostStore
    max_num_running: int
    max_context_tokens: int
    block_size: int = 512
    inline_max_tokens: int = 0
    running: dict[int, DecodeSeq] = field(default_factory=dict)
    waiting: deque[DecodeSeq] = field(default_factory=deque)
    incoming: dict[int, tuple[float, int]] = field(default_factory=dict)
    reserved_pages: dict[int, int] = field(default_factory=dict)
    decode_s: dict[int, float] = field(default_factory=dict)  # each placed request's predicted decode time
    reserve_queue: deque[Any] = field(default_factory=deque)  # RESERVE calls waiting for room (none, baseline)
    inline: list[tuple[int, float]] = field(default_factory=list)
    inline_in_step: list[tuple[int, float]] = field(default_factory=list)  # run by the step under way
    device: DeviceTier | None = None  # its device prefix cache (cluster.device_prefix_blocks)
    num_context_tokens: int = 0
    is_stepping: bool = False
    step_time_s: float = 0.0

    @property
    def num_pages(self) -> int:
        return self.max_context_tokens // self.block_size

    def load_now(self) -> DecodeLoadNow:
        """The load RESERVE sees: placed requests count as running."""
        return DecodeLoadNow(self.num_pages - sum(self.reserved_pages.values()),
                             len(self.running) + len(self.incoming),
                             self.num_context_tokens + sum(tokens for _, tokens in self.incoming.values()))

    def inline_wait_s(self) -> float:
        """An inline prefill placed now waits for half the running step and the inline prefills ahead."""
        return (self.step_time_s / 2 if self.running else 0.0) + sum(compute_s for _, compute_s in self.inline)

    def has_room_for(self, seq: DecodeSeq) -> bool:
        """A batch slot, and its pages beside the running sequences' (the pages the decode role allocates)."""
        if not self.running:
            return True
        num_held = sum(self.reserved_pages.get(i, 0) for i in self.running)
        return (len(self.running) < self.max_num_running
                and num_held + self.reserved_pages.get(seq.request_index, 0) <= self.num_pages)

    def page_holds(self, now: float, predicted_tokens: Mapping[int, int], step_s: float) -> tuple[DecodeHold, ...]:
        """Every sequence's pages over its predicted life (sched/decode_memory.py), as the decode role forecasts
        them: a running one for its predicted output less what it generated (at least one token) at `step_s` a
        token (without a prediction: until its start plus its decode time), a placed one from its predicted decode
        start for its predicted decode time."""
        holds = []
        for index, seq in self.running.items():
            if index in predicted_tokens:
                ends_at = now + max(predicted_tokens[index] - len(seq.gaps), 1) * step_s
            else:
                ends_at = max(seq.started_at + self.decode_s.get(index, 0.0), now + step_s)
            holds.append(DecodeHold(self.reserved_pages.get(index, 0), now, ends_at))
        for index, (ready_at, _) in self.incoming.items():
            starts_at = max(ready_at, now)
            holds.append(DecodeHold(self.reserved_pages.get(index, 0), starts_at,
                                    starts_at + self.decode_s.get(index, 0.0)))
        return tuple(holds)

    def view(self, with_details: bool, predicted_tokens: Mapping[int, int] | None = None,
             step_s: float = 0.0) -> DecodeInstanceView:
        """With `predicted_tokens` (request index -> predicted output tokens) the view carries each request's
        predicted end (decode start + tokens x `step_s`), else prediction-based rejection uses the uniform t_d."""
        running = self.running.values()
        forecast: dict[str, Any] = {}
        if with_details and predicted_tokens is not None:
            forecast = {"running_ends_at": tuple(s.started_at + predicted_tokens.get(s.request_index, 1) * step_s
                                                 for s in running),
                        "incoming_decode_s": tuple(predicted_tokens.get(i, 1) * step_s for i in self.incoming)}
        return DecodeInstanceView(
            instance_id=self.instance_id,
            store_id=self.store.store_id,
            num_running=len(self.running),
            num_context_tokens=self.num_context_tokens,
            max_num_running=self.max_num_running,
            max_context_tokens=self.max_context_tokens,
            running_started_at=tuple(seq.started_at for seq in running) if with_details else (),
            running_tokens=tuple(seq.context_tokens for seq in running) if with_details else (),
            incoming=tuple(self.incoming.values()) if with_details else (),  # includes `waiting`
            inline_max_tokens=self.inline_max_tokens,
            inline_wait_s=self.inline_wait_s(),
            device_id=self.instance_id if self.device is not None else "",
            **forecast,
        )


def build_instances(config: SimConfig, costs: CostModel, index: ShadowIndex, is_replica_aware: bool,
                    device_index: ShadowIndex | None = None) -> tuple[list[PrefillInstance], list[DecodeInstance]]:
    """The prefill instances (groups included) and decode instances of `config.cluster`, each with its host store;
    single prefill instances and decode instances get a device tier publishing to `device_index` when
    cluster.device_prefix_blocks."""
    cluster = config.cluster
    capacity = cluster.dram_blocks_per_host
    pipeline = None
    if cluster.num_prefill_groups:
        pipeline = even_pipeline(costs.predictors.prefill, cluster.stages_per_group, cluster.cpp_chunk_tokens,
                                 costs.chunk_handoff_s)
    prefill = prefill_instances(
        cluster.num_prefill, cluster.num_prefill_groups, pipeline,
        lambda i: HostStore(f"p{i}", capacity, cluster.eviction, index, is_replica_aware))
    if cluster.device_prefix_blocks and device_index is not None:
        for instance in prefill:
            if instance.pipeline is None:  # a group's stages each hold a layer range: no whole block on one
                instance.device = DeviceTier(instance.instance_id, cluster.device_prefix_blocks, device_index)
    decode_capacity = capacity if cluster.decode_hosts_in_pool else 0
    decode = [
        DecodeInstance(f"decode-{i}", HostStore(f"d{i}", decode_capacity, cluster.eviction, index, is_replica_aware),
                       cluster.max_batch_size, costs.max_decode_context_tokens, config.scheduler.block_size,
                       cluster.inline_prefill_max_tokens)
        for i in range(cluster.num_decode)
    ]
    if cluster.device_prefix_blocks and device_index is not None:
        for decode_instance in decode:
            decode_instance.device = DeviceTier(decode_instance.instance_id, cluster.device_prefix_blocks,
                                                device_index)
    return prefill, decode
