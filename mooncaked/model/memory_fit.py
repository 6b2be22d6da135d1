"""Whether a model's weights fit the device before any of them is allocated.

1. `weight_bytes(args, dtype, is_cpu_packed)`: what LlamaForCausalLM allocates for `args` in `dtype`: every
   checkpoint tensor, the transposed output head copy of tied models, the RoPE tables, and with MKL packing
   a second copy of every projection.
2. `free_bytes(device)`: free device memory (CUDA: the driver's free figure; CPU: MemAvailable, which counts
   the page cache a memory-mapped checkpoint occupies as reclaimable).
3. `check_fits(...)` raises ModelDoesNotFit naming both sizes and what to change.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mooncaked.errors import StartupError
from mooncaked.model.config import LayerRange, ModelArgs
from mooncaked.model.weight_names import hf_tensor_shapes

GIB = 1 << 30
_MEMINFO = Path("/proc/meminfo")


class ModelDoesNotFit(StartupError, ValueError):
    """The weights need more memory than the device has free; the message gives both figures."""


def weight_bytes(args: ModelArgs, dtype: torch.dtype, is_cpu_packed: bool, layers: LayerRange | None = None) -> int:
    """Of the whole model, or of the pipeline stage holding `layers`."""
    layers = layers or LayerRange.whole(args)
    shapes = hf_tensor_shapes(args, layers)
    num_elements = sum(_numel(shape) for shape in shapes.values()) + 2 * args.max_position_embeddings * args.head_dim
    embedding = args.vocab_size * args.hidden_size
    if args.tie_word_embeddings and layers.has_head:
        num_elements += embedding  # lm_head's transposed copy
    if args.tie_word_embeddings and layers.has_head and not layers.has_embedding:
        num_elements -= embedding  # a last stage reads the embedding only into its head
    if is_cpu_packed:  # every 2-D weight but the embedding is a projection, the output head included
        num_elements += sum(_numel(shape) for name, shape in shapes.items()
                            if len(shape) == 2 and name != "model.embed_tokens.weight")
        if args.tie_word_embeddings and layers.has_head:
            num_elements += embedding
    return num_elements * dtype.itemsize


def free_bytes(device: torch.device) -> int | None:
    """Free memory on `device` in bytes, or None where it cannot be measured."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"model.device is {device} but this torch sees no CUDA device; use cpu or install a "
                             "CUDA build of torch on a GPU host")
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu" or not _MEMINFO.is_file():
        return None
    for line in _MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_fits(args: ModelArgs, dtype: torch.dtype, device: torch.device, is_cpu_packed: bool, label: str,
               available: int | None = None, layers: LayerRange | None = None) -> None:
    """ModelDoesNotFit when the weights of `args` (of the stage holding `layers`) exceed `available` (default:
    free_bytes(device))."""
    needed = weight_bytes(args, dtype, is_cpu_packed, layers)
    available = free_bytes(device) if available is None else available
    if available is None or needed <= available:
        return
    hint = "a smaller model, a smaller dtype (model.dtype: bfloat16)" if dtype.itemsize > 2 else "a smaller model"
    if is_cpu_packed:
        hint += ", model.cpu_packed_gemm: false (the packed copy doubles the projections)"
    raise ModelDoesNotFit(f"{label} does not fit: its weights need {needed / GIB:.2f} GiB as {dtype} on {device} "
                          f"but only {available / GIB:.2f} GiB is free; use {hint}, or a device with more memory")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
