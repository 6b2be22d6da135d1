"""How many KV pages a worker gets: an explicit count, or as many as its memory budget holds.

1. `page_nbytes(args, block_size, dtype)`: one page of every layer's K and V.
2. `size_kv(budget, ...)`, once the weights are loaded: `worker.num_kv_pages` when set (an override, taken as
   is); else the pages `worker.kv_memory_bytes` holds; else, on CUDA, what `worker.memory_fraction` of the
   memory free before the weights loaded leaves after the weights and the activation workspace (vLLM's
   gpu_memory_utilization, over free rather than total memory so that processes sharing a GPU each take
   their share); else the default budget (DEFAULT_CPU_KV_BYTES on CPU, DEFAULT_MEMORY_FRACTION on CUDA).
3. A budget that holds fewer pages than one request of `max_model_len` tokens raises KVBudgetTooSmall, which
   names the budget, what one request needs and what to set.

The resulting KVSizing is a derived fact, not config: the worker logs it, reports it in LOAD replies, and
`mooncaked check-config` prints the same figures before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncaked.kv.cache_dtype import row_bytes
from mooncaked.model.config import ModelArgs
from mooncaked.runtime.errors import StartupError

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_CPU_KV_BYTES = 192 * MIB
DEFAULT_MEMORY_FRACTION = 0.9


class KVBudgetTooSmall(StartupError, ValueError):
    """The memory budget holds fewer KV pages than one max-length request needs; the message says how much.
    A StartupError: the process exits with status 2 and is not restarted (a restart cannot fix it)."""


@dataclass(frozen=True)
class KVBudget:
    """The worker settings that choose the page count (`worker.*`; at most one of the last two is set)."""

    num_kv_pages: int | None = None
    kv_memory_bytes: int | None = None
    memory_fraction: float | None = None


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's free bytes before and after this worker loaded its weights, and the workspace to keep."""

    free_before_load: int
    free_after_load: int
    workspace_bytes: int


@dataclass(frozen=True)
class KVSizing:
    num_pages: int
    block_size: int
    page_nbytes: int
    origin: str  # which setting chose it, e.g. "worker.kv_memory_bytes = 256 MiB"

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_nbytes

    def describe(self) -> str:
        return (f"KV cache: {self.num_pages} pages = {self.num_tokens} tokens, {self.nbytes / GIB:.2f} GiB "
                f"({self.origin})")


def page_nbytes(args: ModelArgs, block_size: int, dtype: torch.dtype, num_layers: int | None = None,
                cache_dtype: str = "auto") -> int:
    """Bytes of one page: block_size tokens of every layer's KV planes (of `num_layers` on a pipeline stage), in
    `cache_dtype`'s form (kv/cache_dtype.py)."""
    layers = args.num_layers if num_layers is None else num_layers
    return (layers * args.num_kv_planes * block_size * args.num_kv_heads
            * row_bytes(args.kv_head_dim, dtype.itemsize, cache_dtype))


def size_kv(budget: KVBudget, *, args: ModelArgs, block_size: int, dtype: torch.dtype, device_type: str,
            max_model_len: int, device_memory: DeviceMemory | None = None,
            num_layers: int | None = None, cache_dtype: str = "auto") -> KVSizing:
    """The page count for `budget` (see the module docstring); KVBudgetTooSmall below one request's need.
    num_layers: the layers whose KV the pages hold (a pipeline stage's); None: every layer of `args`."""
    per_page = page_nbytes(args, block_size, dtype, num_layers, cache_dtype)
    if budget.num_kv_pages is not None:
        return KVSizing(budget.num_kv_pages, block_size, per_page, "worker.num_kv_pages")
    budget_bytes, origin = _budget_bytes(budget, device_type, device_memory)
    sizing = KVSizing(max(budget_bytes, 0) // per_page, block_size, per_page, origin)
    needed_pages = -(-max_model_len // block_size)
    if sizing.num_pages < needed_pages:
        needed = needed_pages * per_page
        raise KVBudgetTooSmall(
            f"{origin} holds {sizing.num_pages} KV pages ({sizing.num_tokens} tokens) but one request of "
            f"model.max_model_len = {max_model_len} tokens needs {needed_pages} pages of {_size(per_page)} = "
            f"{_size(needed)}; set worker.kv_memory_bytes to at least {needed} ({_size(needed)})"
            f"{_fraction_hint(budget, device_type)} or lower model.max_model_len")
    return sizing


def _budget_bytes(budget: KVBudget, device_type: str, device_memory: DeviceMemory | None) -> tuple[int, str]:
    if budget.kv_memory_bytes is not None:
        return budget.kv_memory_bytes, f"worker.kv_memory_bytes = {_size(budget.kv_memory_bytes)}"
    if device_type != "cuda":
        if budget.memory_fraction is not None:
            raise ValueError("worker.memory_fraction sizes KV from free GPU memory, but model.device is "
                             f"{device_type}; set worker.kv_memory_bytes instead")
        return DEFAULT_CPU_KV_BYTES, f"the default KV budget of {_size(DEFAULT_CPU_KV_BYTES)} on CPU"
    if device_memory is None:
        raise ValueError("sizing KV from worker.memory_fraction needs the device's free memory")
    fraction = DEFAULT_MEMORY_FRACTION if budget.memory_fraction is None else budget.memory_fraction
    weights = device_memory.free_before_load - device_memory.free_after_load
    usable = int(fraction * device_memory.free_before_load) - weights - device_memory.workspace_bytes
    name = "worker.memory_fraction" if budget.memory_fraction is not None else "the default memory_fraction"
    return usable, (f"{name} = {fraction:g} of {_size(device_memory.free_before_load)} free, less "
                    f"{_size(weights)} of weights and {_size(device_memory.workspace_bytes)} of workspace")


def _fraction_hint(budget: KVBudget, device_type: str) -> str:
    if device_type != "cuda" or budget.kv_memory_bytes is not None:
        return ""
    return ", raise worker.memory_fraction, free GPU memory"


def _size(num_bytes: int) -> str:
    """1.50 GiB, 90.0 MiB, 512 MiB, 8192 bytes."""
    if abs(num_bytes) >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    if abs(num_bytes) >= MIB:
        return f"{num_bytes // MIB} MiB" if num_bytes % MIB == 0 else f"{num_bytes / MIB:.2f} MiB"
    return f"{num_bytes} bytes"


def cuda_free_bytes(device: str) -> int | None:
    """Free bytes on a CUDA `device` (None on CPU), after releasing what torch cached."""
    torch_device = torch.device(device)
    if torch_device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(torch_device)
    return int(free)
