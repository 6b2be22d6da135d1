"""Compressed KV pages (`kv.cache_dtype`, kv/cache_dtype.py): quantize on store, dequantize on read (torch).

A packed row is one token's one KV head, [head_dim + 2] one-byte elements: the head_dim values then their
bfloat16 scale (2 bytes). `int8` pages are uint8, the values symmetric int8 (scale max |x| / 127); `fp8_e4m3`
pages are float8_e4m3fn, the values e4m3 (scale max |x| / 448, e4m3's largest). A row of zeros keeps scale 0 and
dequantizes to 0. Every attention read dequantizes the tokens it gathered into the query's dtype, so no
full-precision copy of the pages is kept.
"""

from __future__ import annotations

import torch

INT8_SCALE_BYTES = 2  # kv/cache_dtype.py's (kernels sit below kv/; tests/kernels/test_quantized_kv.py checks)
_LARGEST = {torch.uint8: 127.0, torch.float8_e4m3fn: 448.0}  # the format's largest value


def is_packed(pages: torch.Tensor) -> bool:
    """Whether `pages` hold packed rows (int8 as uint8, or fp8_e4m3) rather than values of the model's dtype."""
    return pages.dtype in _LARGEST


def quantize(x: torch.Tensor, pages_dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """x [..., D] (any float dtype) -> packed rows [..., D + 2] of `pages_dtype` (uint8: int8 values; or
    float8_e4m3fn)."""
    values = x.float()
    scale = (values.abs().amax(dim=-1, keepdim=True) / _LARGEST[pages_dtype]).to(torch.bfloat16)
    divisor = scale.float()
    scaled = torch.where(divisor > 0, values / divisor.clamp(min=torch.finfo(torch.bfloat16).tiny), 0.0)
    if pages_dtype == torch.uint8:
        payload = scaled.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:  # e4m3 saturates at 448, which a scale rounded down to bfloat16 may exceed by a step
        payload = scaled.clamp_(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([payload, scale.view(torch.uint8)], dim=-1).view(pages_dtype)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed rows [..., D + 2] (uint8 or float8_e4m3fn) -> [..., D] in `dtype`."""
    head_dim = packed.shape[-1] - INT8_SCALE_BYTES
    payload = packed[..., :head_dim]
    values = payload.view(torch.int8).to(torch.float32) if packed.dtype == torch.uint8 else payload.to(torch.float32)
    scale = packed[..., head_dim:].contiguous().view(torch.uint8).view(torch.bfloat16).to(torch.float32)
    return (values * scale).to(dtype)


def as_bytes(pages: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (fp8 tensors have no index_copy_ on CPU)."""
    return pages if pages.dtype == torch.uint8 else pages.view(torch.uint8)
