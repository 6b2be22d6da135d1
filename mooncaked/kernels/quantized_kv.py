"""Compressed KV pages (`kv.cache_dtype`, kv/cache_dtype.py): quantize on store, dequantize on read (torch).

A packed row is one token's one KV head, [head_dim + 2] one-byte elements: the head_dim values then their
bfloat16 scale (2 bytes). `int8` pages are uint8, the values symmetric int8 (scale max |x| / 127); `fp8_e4m3`
pages are float8_e4m3fn, the values e4m3 (scale max |x| / 448, e4m3's largest). A row of zeros keeps scale 0 and
dequantizes to 0. Every attention read dequantizes the tokens it gathered into the query's dtype, so no
full-precision copy of the pages is kept.

The rows the model stores are rotated first (`rotation`, applied by engine/runner.py, not by the kernels): an
orthogonal R (a normalized Hadamard matrix, block-diagonal where head_dim is not a power of two) spreads a head's
few large channels over all of them, so the per-row scale max |x| / 127 shrinks and int8's rounding step with it
(the embedded SmolLM2's logprob error on a fixed text: 0.030 -> 0.016 nats/token in fp32, 0.063 -> 0.030 in
bf16). Attention needs no unrotation of the pages: q.k = (qR).(kR), and sum p_j (v_j R) = (sum p_j v_j) R, so
the runner rotates the new tokens' q, k, v before attention and the output back after (four [D, D] products per
new token and head), never the gathered rows.
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


def rotation(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """R [D, D] float32, orthogonal (R R^T = I): normalized Hadamard blocks along the diagonal, one per set bit of
    D from the highest (64 -> one block; MLA's 576 -> 512 and 64)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    blocks = []
    for bit in reversed(range(head_dim.bit_length())):
        if head_dim >> bit & 1:
            block = torch.ones(1, 1)
            while block.shape[0] < 1 << bit:  # Sylvester: H_2n = [[H, H], [H, -H]]
                block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
            blocks.append(block / block.shape[0] ** 0.5)
    return torch.block_diag(*blocks).to(device)


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ matrix [D, D], computed in float32 and returned in x's dtype (R to rotate, R.T to rotate back)."""
    return (x.float() @ matrix).to(x.dtype)


def as_bytes(pages: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (fp8 tensors have no index_copy_ on CPU)."""
    return pages if pages.dtype == torch.uint8 else pages.view(torch.uint8)
