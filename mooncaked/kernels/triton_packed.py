"""Compressed KV rows in Triton (`kv.cache_dtype` int8 / fp8_e4m3): the layout of kernels/quantized_kv.py.

Stages:
  1. Host: `kv_format(pages)` names the row format as a constexpr (UNPACKED, INT8, FP8_E4M3) and `kernel_pages`
     hands packed pages to the kernel as uint8 (the same bytes), so one pointer type serves both formats.
  2. `store_packed_rows` (the store kernel): one token's [Hkv, D] rows -> per-row scale = max |x| / largest,
     rounded to bfloat16 (nearest even, as torch's cast), the values divided by it, clamped (+-127, +-448) and
     rounded to nearest even on the format's grid (int8: integers; e4m3: steps of 2^(exponent - 3), at least
     2^-9), then the scale's two bytes. The e4m3 rounding is done in float32 arithmetic, so the final cast is
     exact: Triton's interpreter rounds a carry into the next binade wrongly (127.9 -> 64), the GPU does not.
  3. `load_kv_tile` (the attention kernels): gathers [BLOCK_N, D] rows and, for packed rows, dequantizes them to
     float32 (values * scale) in registers; no full-precision copy of the pages is ever written.
A packed row is [D + 2] bytes: D payload bytes, then the bfloat16 scale little-endian (low byte first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

UNPACKED = 0
INT8 = 1
FP8_E4M3 = 2
_FORMATS = {torch.uint8: INT8, torch.float8_e4m3fn: FP8_E4M3}


def kv_format(pages: torch.Tensor) -> int:
    """The constexpr row format of `pages` (UNPACKED for pages in the model's dtype)."""
    return _FORMATS.get(pages.dtype, UNPACKED)


def kernel_pages(pages: torch.Tensor) -> torch.Tensor:
    """What the kernel reads: packed pages as uint8 (same memory and strides), others as they are."""
    return pages.view(torch.uint8) if pages.dtype == torch.float8_e4m3fn else pages


@triton.jit  # type: ignore[misc]
def load_kv_tile(  # type: ignore[no-untyped-def]
    pages_ptr, row_offs, offs_d, n_mask,
    HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """row_offs [BLOCK_N] (element offset of each token's row), offs_d [BLOCK_D] -> [BLOCK_N, BLOCK_D] (the
    pages' dtype when UNPACKED, else float32); masked rows and columns are 0."""
    mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tile = tl.load(pages_ptr + row_offs[:, None] + offs_d[None, :], mask=mask, other=0)
    if KV_FORMAT != 0:
        if KV_FORMAT == 1:
            values = tile.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            values = tile.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        low = tl.load(pages_ptr + row_offs + HEAD_DIM, mask=n_mask, other=0).to(tl.uint32)
        high = tl.load(pages_ptr + row_offs + HEAD_DIM + 1, mask=n_mask, other=0).to(tl.uint32)
        scale = (((high << 8) | low) << 16).to(tl.float32, bitcast=True)  # bfloat16 bits -> float32, exact
        tile = values * scale[:, None]
    return tile


@triton.jit  # type: ignore[misc]
def store_packed_rows(  # type: ignore[no-untyped-def]
    pages_ptr, row_offs, offs_d, x, row_mask,
    HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """x [BLOCK_H, BLOCK_D] float32 (0 outside HEAD_DIM) -> packed rows at row_offs [BLOCK_H] where row_mask."""
    largest = 127.0
    if KV_FORMAT == 2:
        largest = 448.0
    bits = (tl.max(tl.abs(x), 1) / largest).to(tl.uint32, bitcast=True)
    scale_bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even bfloat16 (finite inputs)
    divisor = (scale_bits << 16).to(tl.float32, bitcast=True)
    is_zero = divisor == 0.0
    scaled = tl.where(is_zero[:, None], 0.0, x / tl.where(is_zero, 1.0, divisor)[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -largest), largest)
    if KV_FORMAT == 1:
        payload = _round_half_even(scaled).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        exponent = ((scaled.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(max(e, -6) - 3)
        on_grid = _round_half_even(scaled / step) * step  # e4m3 holds it exactly (<= 448 after the clamp)
        payload = on_grid.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(pages_ptr + row_offs[:, None] + offs_d[None, :], payload, mask=mask)
    tl.store(pages_ptr + row_offs + HEAD_DIM, (scale_bits & 0xFF).to(tl.uint8), mask=row_mask)
    tl.store(pages_ptr + row_offs + HEAD_DIM + 1, ((scale_bits >> 8) & 0xFF).to(tl.uint8), mask=row_mask)


@triton.jit  # type: ignore[misc]
def _round_half_even(x):  # type: ignore[no-untyped-def]
    """x float32 -> the nearest integer (float32), ties to even, as torch.round."""
    rounded = tl.floor(x + 0.5)
    is_odd_tie = ((rounded - x) == 0.5) & ((rounded - 2.0 * tl.floor(rounded * 0.5)) != 0.0)
    return tl.where(is_odd_tie, rounded - 1.0, rounded)
