"""MKL-packed fp32 GEMM for CPU decode: few-row products against a weight packed once at load time.

1. `pack(weight_t)` copies an fp32 CPU weight [in, out] into MKL's packed panel layout (as many bytes as the
   weight), then checks the packed product against `torch.matmul` at several row counts; it returns None
   when this torch has no MKL packing or the check fails, and the caller keeps the plain weight.
2. `without_plain(packed)`: the same packed weight no longer referring to the plain one, so the caller can
   free it (a decode process holds its projections once, packed).
3. `matmul(x, packed, bias)`: x [M, in] @ W (+ bias) -> [M, out] through MKL's packed compute.

Why: for 1-64 rows (decode batches), the packed compute streams the weight about 1.5x faster than a plain
sgemm (SmolLM2's layer projections at 8 rows, 2 threads: 49 -> 32 ms per step); its cost per row stays flat
as rows grow, so at prefill sizes (256-1024 rows) it is about 1.7x slower: where both copies are kept, only
products of at most PACKED_MAX_ROWS rows take it.
The packed layout does not depend on the row count given at pack time (checked in `pack`): one copy serves
every decode batch size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

# Which copies of its projections a CPU fp32 model keeps: `plain` (prefill: packing does not help it), `packed`
# (decode: the packed copy replaces the plain one and serves every product), `both` (a switchable worker, and
# today's default for callers that name none: packed up to PACKED_MAX_ROWS rows, plain above).
Packing = Literal["plain", "packed", "both"]
PACKINGS: tuple[Packing, ...] = ("plain", "packed", "both")

PACKED_MAX_ROWS = 64
_PROBE_ROWS = (1, 5, PACKED_MAX_ROWS)
_PROBE_ROWS_EVERY = (*_PROBE_ROWS, 2 * PACKED_MAX_ROWS + 1)
_PACK_HINT_ROWS = 8


def is_available() -> bool:
    """Whether this torch build exposes MKL's packed sgemm."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@dataclass(frozen=True)
class PackedWeight:
    """A weight's MKL-packed copy and the [out, in] view of the plain weight the op needs for its shape."""

    packed: torch.Tensor  # opaque MKL layout
    weight: torch.Tensor  # [out, in] view of weight_t, or a placeholder: gives the op its shape (its fallback
    # path, which would read it, is never taken)


def pack(weight_t: torch.Tensor, is_every_row_count: bool = False) -> PackedWeight | None:
    """weight_t fp32 CPU [in, out] -> its PackedWeight, or None where packing is unavailable or wrong.
    `is_every_row_count`: the copy will also serve products of more than PACKED_MAX_ROWS rows (checked too)."""
    if weight_t.dtype != torch.float32 or weight_t.device.type != "cpu" or not is_available():
        return None
    weight_t = weight_t.detach()
    dense = weight_t.t().contiguous()  # [out, in]: the layout MKL packs from (transposed B)
    packed = PackedWeight(torch.ops.mkl._mkl_reorder_linear_weight(dense, _PACK_HINT_ROWS), weight_t.t())
    del dense
    if not _agrees(packed, weight_t, _PROBE_ROWS_EVERY if is_every_row_count else _PROBE_ROWS):
        logger.warning("MKL packed GEMM disagrees with torch.matmul for a %s weight; using plain GEMM",
                       tuple(weight_t.shape))
        return None
    return packed


def without_plain(weight: PackedWeight) -> PackedWeight:
    """`weight` whose shape-giving tensor is a zero-stride placeholder instead of a view of the plain weight."""
    placeholder = torch.zeros((), dtype=weight.weight.dtype).expand(weight.weight.shape)  # [out, in], 4 bytes
    return PackedWeight(weight.packed, placeholder)


def matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [M, in] (M <= PACKED_MAX_ROWS) @ W (+ bias [out]) -> [M, out], reading the packed copy."""
    # The row count passed is x's own, so the op never takes its unpacked fallback.
    result: torch.Tensor = torch.ops.mkl._mkl_linear(x, weight.packed, weight.weight, bias, x.shape[0])
    return result


def _agrees(packed: PackedWeight, weight_t: torch.Tensor, probe_rows: tuple[int, ...]) -> bool:
    generator = torch.Generator().manual_seed(0)
    for num_rows in probe_rows:
        x = torch.randn(num_rows, weight_t.shape[0], generator=generator)
        expected = torch.matmul(x, weight_t)
        tolerance = 1e-4 * max(1.0, float(expected.abs().max()))
        if not torch.allclose(matmul(x, packed), expected, rtol=1e-4, atol=tolerance):
            return False
    return True
