"""One process's model replica and the KV pages beside it (a worker without tensor-parallel ranks; with them,
tp_worker.start_ranks builds the same from the ranks).

1. On the compute thread: note the device's free memory, then load the model (a prefill group member: only its
   stage's layers; on CPU mapped from the host's shared weight file; the projections packed as the role wants:
   memory_plan.worker_packing).
2. On the compute thread: size the KV pages from the memory budget once the weights are in (engine.kv_budget; a
   budget too small for one max-length request raises KVBudgetTooSmall), leaving room for the activations of
   the largest batch on CUDA.
3. Allocate the pages (for the replica's layers) and build the runner; the worker then owns all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from mooncaked.config import Config, InstanceConfig, WorkerSection
from mooncaked.config.memory_plan import worker_packing
from mooncaked.engine.kv_budget import DeviceMemory, KVBudget, KVSizing, cuda_free_bytes, size_kv
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.config import LayerRange
from mooncaked.model.loader import LoadedModel, load_model
from mooncaked.model.memory_fit import activation_bytes

T = TypeVar("T")


class Compute(Protocol):
    """Worker.compute: runs `fn` on the worker's compute thread."""

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...


async def load_replica(config: Config, instance: InstanceConfig, section: WorkerSection, layers: LayerRange | None,
                       compute: Compute) -> tuple[LoadedModel, KVSizing, KVPages, ModelRunner]:
    """The model (or `layers` of it), its KV sizing, the pages and the runner over them."""
    model = config.model
    free_before_load = await compute(cuda_free_bytes, model.device)
    loaded = await compute(
        load_model, model.source, dtype=model.dtype, device=model.device, seed=model.seed,
        cpu_packed_gemm=model.cpu_packed_gemm, packing=worker_packing(instance.role, section.switchable),
        weight_cache_dir=model.weight_cache_dir if model.share_weights else None, layers=layers)
    kv_sizing = await compute(size_replica_kv, config, section, loaded, free_before_load, layers)
    kv_pages = KVPages.for_model(loaded.args, num_pages=kv_sizing.num_pages, block_size=config.kv.block_size,
                                 dtype=loaded.dtype, device=loaded.device, layers=layers,
                                 cache_dtype=config.kv.cache_dtype)
    runner = ModelRunner(loaded.model, kv_pages, backend=model.kernel_backend, cuda_graphs=model.cuda_graphs,
                         max_batch_size=section.max_batch_size, max_seq_len=model.max_model_len)
    return loaded, kv_sizing, kv_pages, runner


def size_replica_kv(config: Config, section: WorkerSection, loaded: LoadedModel, free_before_load: int | None,
                    layers: LayerRange | None) -> KVSizing:
    """Compute thread: the page count from the budget, once the weights are in (KVBudgetTooSmall if short)."""
    model = config.model
    device_memory = None
    if free_before_load is not None:
        workspace = activation_bytes(loaded.args, section.max_batch_tokens, section.max_batch_size, loaded.dtype)
        device_memory = DeviceMemory(free_before_load, cuda_free_bytes(model.device) or 0, workspace)
    budget = KVBudget(section.num_kv_pages, section.kv_memory_bytes, section.memory_fraction)
    return size_kv(budget, args=loaded.args, block_size=config.kv.block_size, dtype=loaded.dtype,
                   device_type=loaded.device.type, max_model_len=model.max_model_len,
                   device_memory=device_memory, num_layers=None if layers is None else layers.size,
                   cache_dtype=config.kv.cache_dtype)
