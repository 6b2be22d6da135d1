"""Rotary position embeddings (Hugging Face "rotate half" layout) with optional Llama-3 frequency scaling.

1. `inverse_frequencies` computes the per-pair frequencies exactly as transformers does (fp32), scaled for
   `rope_scaling.rope_type == "llama3"`, or divided by per-frequency factors (a GGUF's `rope_freqs` tensor,
   which is how llama.cpp files carry Llama 3.1 scaling).
2. `RopeCache` precomputes cos and a sign-folded sin for every position once, in the model dtype.
3. `RopeCache.lookup(positions)` and `apply_rope` rotate q and k together per forward.
"""

from __future__ import annotations

import math

import torch

from mooncaked.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                        freq_factors: tuple[float, ...] | None = None) -> torch.Tensor:
    """[head_dim // 2] fp32 frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RopeCache:
    """cos/sin tables for positions 0..max_positions-1; immutable after construction (owned by the model)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int,
                 dtype: torch.dtype, device: torch.device | str, freq_factors: tuple[float, ...] | None = None) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling, freq_factors)
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], the same fp32 products transformers forms
        self.max_positions = max_positions
        self.cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(dtype=dtype, device=device)  # [P, D]
        # sin with rotate_half's sign folded in: rotate_half(x) * sin == swap_halves(x) * signed_sin
        self.signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)  # [P, D]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> (cos [T, 1, D], signed_sin [T, 1, D])."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.signed_sin.index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides) -> rotated [T, H, D] contiguous."""
    half = x.shape[-1] // 2
    # roll by half swaps the two halves in one op; addcmul folds the second product into the sum
    return torch.addcmul(x * cos, torch.roll(x, shifts=half, dims=-1), signed_sin)
