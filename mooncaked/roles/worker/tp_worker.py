"""A worker instance with N > 1 ranks (its `tensor_parallel_size` setting, else the model's): N rank processes,
one set of store moves.

1. `start_ranks(config, instance, section)` (compute thread) sizes the KV pages from the budget (every rank holds
   the same page count, for its KV heads), then starts a TensorParallelRunner whose ranks 1..N-1 keep their pages in
   memory this process maps too (engine/tp_pages.py). The worker then holds rank 0's shard as its model, the runner
   as its runner, and `ShardedPages` over every rank's pages as its KV pages for store moves.
2. Store moves are rank 0's: objects are whole (every KV head; the same bytes at every degree), and rank 0 copies
   between their bytes (this host's mapped store pool, or staging for another host's store) and each rank's pages
   with strided copies (engine/tp_copy.py): loads fill every rank's pages, stores read each KV head from the first
   rank holding it. A prefill forward's layer callbacks run on rank 0 and gate the other ranks, so a rank computes
   layer i only once layer i of the prefix is in its pages, and rank 0 queues layer i's store only after every rank
   wrote layer i (the layer's all-reduces come after its KV writes). The blocks are committed, as at N = 1, after
   every layer write is done.
3. `RankWatch` (event loop) watches the rank processes: one that exits fails the instance (`on_failure`; the
   role stops and exits non-zero, so the supervisor restarts the whole instance). Steps already in flight fail
   with RankFailed within the group's deadline (transfer.timeout_s).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from mooncaked.config import Config, InstanceConfig, WorkerSection
from mooncaked.engine.kv_budget import KVBudget, KVSizing, size_kv
from mooncaked.engine.tp_pages import ShardedPages
from mooncaked.engine.tp_rank import RankSpec
from mooncaked.engine.tp_runner import TensorParallelRunner
from mooncaked.memory_plan import worker_packing
from mooncaked.model.loader import model_args, resolve_dtype

logger = logging.getLogger(__name__)


def start_ranks(config: Config, instance: InstanceConfig,
                section: WorkerSection) -> tuple[TensorParallelRunner, KVSizing, ShardedPages]:
    """Compute thread: start `instance`'s ranks (rank 0 here); the runner, the page count and every rank's
    pages."""
    model = config.model
    args = model_args(model.source)
    dtype = resolve_dtype(model.dtype, model.device)
    budget = KVBudget(section.num_kv_pages, section.kv_memory_bytes, section.memory_fraction)
    packing = worker_packing(instance.role, section.switchable) if model.cpu_packed_gemm else "plain"
    sizing = size_kv(budget, args=args, block_size=config.kv.block_size, dtype=dtype, device_type="cpu",
                     max_model_len=model.max_model_len, device_memory=None, num_layers=None)
    spec = RankSpec(source=model.source, num_pages=sizing.num_pages, block_size=config.kv.block_size,
                    dtype=model.dtype, device=model.device, seed=model.seed,
                    packing=packing, backend=model.kernel_backend,
                    num_threads=config.runtime.num_threads, timeout_s=config.transfer.timeout_s,
                    is_pages_shared=True)
    runner = TensorParallelRunner.start(spec, config.tensor_parallel_size_of(instance))
    return runner, sizing, ShardedPages(runner.rank_pages, args)


class RankWatch:
    """Owns the event loop's readers on the rank processes' sentinels."""

    def __init__(self, runner: TensorParallelRunner, on_failure: Callable[[str], None]) -> None:
        self.runner = runner
        self.on_failure = on_failure
        self._loop = asyncio.get_running_loop()
        self._sentinels = [process.sentinel for process in runner.processes]
        for rank, sentinel in enumerate(self._sentinels, start=1):
            self._loop.add_reader(sentinel, self._exited, rank)

    def _exited(self, rank: int) -> None:
        self.close()
        process = self.runner.processes[rank - 1]
        process.join(1.0)  # its sentinel closes as it exits, a moment before it can be reaped with its code
        self.on_failure(f"tensor-parallel rank {rank} exited (exit code {process.exitcode})")

    def close(self) -> None:
        for sentinel in self._sentinels:
            self._loop.remove_reader(sentinel)
        self._sentinels = []
