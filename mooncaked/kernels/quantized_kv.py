"""int8 KV pages (`kv.cache_dtype: int8`, kv/cache_dtype.py): quantize on store, dequantize on read (torch).

A packed row is one token's one KV head: uint8 [head_dim + 2], the head_dim int8 values then their bfloat16 scale
(max |x| / 127; 0 rows keep scale 0 and dequantize to 0). Pages are uint8 [P, B, Hkv, head_dim + 2]; every
attention read dequantizes the tokens it gathered into the query's dtype, so no full-precision copy of the
pages is kept.
"""

from __future__ import annotations

import torch

INT8_SCALE_BYTES = 2  # kv/cache_dtype.py's (kernels sit below kv/; tests/kernels/test_quantized_kv.py checks)


def is_packed(pages: torch.Tensor) -> bool:
    """Whether `pages` hold packed int8 rows (uint8) rather than values of the model's dtype."""
    return pages.dtype == torch.uint8


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> packed uint8 [..., D + 2]."""
    values = x.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / 127.0
    scale_bf16 = scale.to(torch.bfloat16)
    divisor = scale_bf16.float()
    quantized = torch.where(divisor > 0, values / divisor.clamp(min=torch.finfo(torch.bfloat16).tiny), 0.0)
    q8 = quantized.round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q8.view(torch.uint8), scale_bf16.view(torch.uint8)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [..., D + 2] -> [..., D] in `dtype`."""
    head_dim = packed.shape[-1] - INT8_SCALE_BYTES
    values = packed[..., :head_dim].view(torch.int8).to(torch.float32)
    scale = packed[..., head_dim:].contiguous().view(torch.bfloat16).to(torch.float32)
    return (values * scale).to(dtype)
