"""A worker instance with N > 1 ranks (its `tensor_parallel_size` setting, else the model's): N rank processes,
one set of store moves.

1. `start_ranks(config, instance, section)` (compute thread) sizes the KV pages from the budget (every rank holds
   the same page count, for its KV heads; on CUDA the budget is each rank's device's), then starts a
   TensorParallelRunner whose ranks 1..N-1 keep their pages where this process maps them too (host memory it
   created on CPU; on GPUs their own devices' memory, opened through CUDA IPC: engine/tp_pages.py). The worker
   then holds rank 0's shard as its model, the runner as its runner, and `ShardedPages` over every rank's pages
   as its KV pages for store moves.
2. Store moves are rank 0's: objects are whole (every KV head; the same bytes at every degree), and rank 0 copies
   between their bytes and each rank's pages: strided host copies with this host's mapped store pool (CPU,
   engine/tp_copy.py), else through staging rows (engine/kv_copy.py; on CUDA a copy stream per rank's device).
   Loads fill every rank's pages, stores read each KV head from the first rank holding it. A prefill forward's
   layer callbacks run on rank 0 and gate the other ranks, so a rank computes layer i only once layer i of the
   prefix is in its pages (loads are complete on the host before the callback returns), and rank 0 queues layer
   i's store only after every rank wrote layer i (the layer's all-reduces come after its KV writes; on CUDA the
   copy waits for rank 0's layer-i event, which completes only once every rank's all-reduce of layer i ran).
   The blocks are committed, as at N = 1, after every layer write is done.
3. `RankWatch` (event loop) watches the rank processes: one that exits fails the instance (`on_failure`; the
   role stops and exits non-zero, so the supervisor restarts the whole instance). Steps already in flight fail
   with RankFailed within the group's deadline (transfer.timeout_s).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mooncaked.config import Config, InstanceConfig, WorkerSection
from mooncaked.config.memory_plan import worker_packing
from mooncaked.engine.kv_budget import DeviceMemory, KVBudget, KVSizing, cuda_free_bytes, size_kv
from mooncaked.engine.tp.pages import ShardedPages
from mooncaked.engine.tp.rank import RankSpec
from mooncaked.engine.tp.runner import TensorParallelRunner
from mooncaked.model.config import LayerRange, ModelArgs
from mooncaked.model.loader import model_args, resolve_dtype
from mooncaked.model.memory_fit import activation_bytes, weight_bytes
from mooncaked.model.packed_gemm import Packing
from mooncaked.model.tensor_parallel import rank_kv_args

logger = logging.getLogger(__name__)


def start_ranks(config: Config, instance: InstanceConfig, section: WorkerSection,
                layers: LayerRange | None) -> tuple[TensorParallelRunner, KVSizing, ShardedPages]:
    """Compute thread: start `instance`'s ranks (rank 0 here), each holding `layers` (a prefill group stage's;
    None: every layer); the runner, the page count and every rank's pages."""
    model = config.model
    args = model_args(model.source)
    num_ranks = config.tensor_parallel_size_of(instance)
    packing = worker_packing(instance.role, section.switchable) if model.cpu_packed_gemm else "plain"
    sizing = _size_kv_per_rank(config, section, args, num_ranks, packing, layers)
    spec = RankSpec(source=model.source, num_pages=sizing.num_pages, block_size=config.kv.block_size,
                    dtype=model.dtype, device=model.device, seed=model.seed,
                    packing=packing, backend=model.kernel_backend,
                    num_threads=config.runtime.num_threads, timeout_s=config.transfer.timeout_s,
                    is_pages_shared=True, layers=layers, is_expert_parallel=model.expert_parallel,
                    cache_dtype=config.kv.cache_dtype)
    runner = TensorParallelRunner.start(spec, num_ranks)
    return runner, sizing, ShardedPages(runner.rank_pages, args)


def _size_kv_per_rank(config: Config, section: WorkerSection, args: ModelArgs, num_ranks: int,
                      packing: Packing, layers: LayerRange | None) -> KVSizing:
    """The page count every rank holds. CPU: the budget is the instance's, over whole pages (every KV head),
    as at N = 1. CUDA: the budget is each rank's device's (worker.memory_fraction of its free memory, less the
    rank's weights and workspace; or worker.kv_memory_bytes), over the pages of a rank's KV heads."""
    model = config.model
    dtype = resolve_dtype(model.dtype, model.device)
    budget = KVBudget(section.num_kv_pages, section.kv_memory_bytes, section.memory_fraction)
    free_before_load = cuda_free_bytes(model.device)
    num_layers = None if layers is None else layers.size
    if free_before_load is None:
        return size_kv(budget, args=args, block_size=config.kv.block_size, dtype=dtype, device_type="cpu",
                       max_model_len=model.max_model_len, num_layers=num_layers, cache_dtype=config.kv.cache_dtype)
    weights = weight_bytes(args, dtype, packing, layers, num_ranks=num_ranks)
    workspace = activation_bytes(args, section.max_batch_tokens, section.max_batch_size, dtype)
    device_memory = DeviceMemory(free_before_load, free_before_load - weights, workspace)
    return size_kv(budget, args=rank_kv_args(args, num_ranks), block_size=config.kv.block_size, dtype=dtype,
                   device_type="cuda", max_model_len=model.max_model_len, device_memory=device_memory,
                   num_layers=num_layers, cache_dtype=config.kv.cache_dtype)


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
