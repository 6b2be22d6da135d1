"""One measured prefill of `mooncaked bench layerwise` per mode (see bench/layerwise.py for the modes).

Every run plans a fresh random prompt (no accidental reuse), times from the moment the store metadata is
settled (lookup and allocate done, the same work in every mode) to the first token, and gives everything back.
Each run also reads the worker's layer timeline: how long the compute thread stood still between layers
(`stall_s`: waiting for a load, queueing stores) and its median layer time (`layer_s`). Unlike wall times,
neither counts the time other processes on a shared machine take from the compute core.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import numpy as np

from mooncaked.engine.timeline import LayerTimeline
from mooncaked.kv.keys import block_keys
from mooncaked.roles.worker.kv.plan import KvPlan, plan_prompt_kv
from mooncaked.roles.worker.messages import Destination, SamplingSpec
from mooncaked.roles.worker.prefill.forward import run_prefill_forward
from mooncaked.roles.worker.worker import Worker
from mooncaked.store.move_ends import Staging

STORE_MODES = ("none", "layerwise", "serialized")
LOAD_MODES = ("no_prefix", "in_pages", "load_layerwise", "load_serial", "transfer")
REMOTE_STORE = "s_decode"
TIMEOUT_S = 300.0
GREEDY = SamplingSpec(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class RunTimes:
    wall_s: float  # the measured time (to the first token; `transfer`: to the last layer in the pages)
    stall_s: float  # compute thread between layers: before layer 0 (from the start) and between two layers
    layer_s: float  # median time of one layer's compute


class ModeRunner:
    """Owns the benchmark's random source, prompt counter and seeding buffers; the worker is borrowed."""

    def __init__(self, worker: Worker, prefix_fraction: float) -> None:
        assert worker.loaded is not None
        self.worker = worker
        self.prefix_fraction = prefix_fraction
        self.vocab_size = worker.loaded.args.vocab_size
        self.rng = random.Random(0)
        self.num_runs = 0
        self._seeds: dict[int, Staging] = {}  # number of blocks -> registered random bytes

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab_size) for _ in range(length)]

    def num_prefix_blocks(self, length: int) -> int:
        block_size = self.worker.block_size
        return min(round(self.prefix_fraction * -(-length // block_size)), (length - 1) // block_size)

    async def run(self, mode: str, length: int) -> RunTimes:
        self.num_runs += 1
        timeline = self.worker.timeline = LayerTimeline()
        try:
            if mode in STORE_MODES:
                started, wall_s = await self._store_run(mode, self.prompt(length))
            else:
                started, wall_s = await self._load_run(mode, self.prompt(length))
        finally:
            self.worker.timeline = None
        return _times(timeline, started, wall_s)

    # ---- storing -------------------------------------------------------------------------------------
    async def _store_run(self, mode: str, tokens: list[int]) -> tuple[float, float]:
        worker = self.worker
        keys = block_keys(tokens, worker.block_size, worker.namespace)
        remote = await worker.stores.client(REMOTE_STORE)
        reply = await remote.allocate(keys, worker.block_nbytes, 60_000) if mode != "none" else None
        destinations = [Destination(i, h) for i, h in enumerate(reply.handles)] if reply is not None else []
        plan = await plan_prompt_kv(worker, f"bench-{mode}-{self.num_runs}", tokens, keys, timeout_s=TIMEOUT_S,
                                    decode_store=REMOTE_STORE, destinations=destinations)
        handles = plan.local_handles
        if mode == "none":
            plan.local_handles = []  # stores nothing; given back (aborted) at close
        try:
            started = time.perf_counter()
            await worker.compute(_store_forward, worker, plan, mode == "serialized")
            await plan.kv.wait_writes(TIMEOUT_S)
            return started, time.perf_counter() - started
        finally:
            plan.local_handles = handles
            await plan.close(commit=False)
            if reply is not None and reply.handles:
                await remote.abort([h.handle_id for h in reply.handles])

    # ---- loading -------------------------------------------------------------------------------------
    async def _load_run(self, mode: str, tokens: list[int]) -> tuple[float, float]:
        worker = self.worker
        keys = block_keys(tokens, worker.block_size, worker.namespace)
        num_prefix = 0 if mode == "no_prefix" else self.num_prefix_blocks(len(tokens))
        if num_prefix:
            await self._seed_remote(keys[:num_prefix])
        plan = await plan_prompt_kv(worker, f"bench-{mode}-{self.num_runs}", tokens, keys, timeout_s=TIMEOUT_S,
                                    fetch_store=REMOTE_STORE if num_prefix else "", num_fetch_blocks=num_prefix)
        handles, plan.local_handles = plan.local_handles, []  # loading alone: the loader runs already, no await
        try:
            assert plan.num_prefix_blocks == num_prefix, "the seeded prefix was not found"
            if mode == "in_pages":
                await plan.kv.wait_loaded()
            started = time.perf_counter()  # the loader was started at the end of planning
            if mode in ("load_serial", "transfer"):
                await plan.kv.wait_loaded()
            if mode != "transfer":
                await worker.compute(run_prefill_forward, worker, [plan], [GREEDY])
            return started, time.perf_counter() - started
        finally:
            plan.local_handles = handles  # aborted by close
            await plan.close(commit=False)

    async def _seed_remote(self, keys: list[bytes]) -> None:
        """Commit `keys` into the other host's store, untimed (random finite values: the bytes' content does not
        change the time)."""
        worker = self.worker
        remote = await worker.stores.client(REMOTE_STORE)
        reply = await remote.allocate(keys, worker.block_nbytes, 60_000)
        if not reply.handles:
            return
        staging = self._seeds.get(len(keys))
        if staging is None:
            values = np.random.default_rng(len(keys)).standard_normal(len(keys) * worker.block_nbytes // 4)
            data = values.astype(np.float32).view(np.uint8)
            staging = self._seeds[len(keys)] = remote.register_staging(f"bench-seed-{len(keys)}", data)
        await remote.write_blocks(staging, reply.handles)
        await remote.commit([h.handle_id for h in reply.handles])


def _times(timeline: LayerTimeline, started: float, wall_s: float) -> RunTimes:
    starts = {e.layer: e.at for e in timeline.events() if e.kind == "compute" and e.edge == "start"}
    ends = {e.layer: e.at for e in timeline.events() if e.kind == "compute" and e.edge == "end"}
    if not starts:
        return RunTimes(wall_s, 0.0, 0.0)
    stall_s = starts[0] - started + sum(starts[i] - ends[i - 1] for i in starts if i > 0)
    return RunTimes(wall_s, stall_s, statistics.median(ends[i] - starts[i] for i in starts))


def _store_forward(worker: Worker, plan: KvPlan, is_serialized: bool) -> None:
    """Compute thread: the prefill, storing layer by layer, or every layer after the whole forward."""
    if not is_serialized:
        run_prefill_forward(worker, [plan], [GREEDY])
        return
    saved, plan.destinations, plan.local_handles = (plan.destinations, plan.local_handles), {}, []
    run_prefill_forward(worker, [plan], [GREEDY])
    plan.destinations, plan.local_handles = saved
    assert worker.kv_pages is not None
    for layer in range(worker.kv_pages.num_layers):
        plan.store_layer(layer)
