"""Rotary position embeddings (Hugging Face "rotate half" layout) with the RoPE scalings transformers applies.

1. `inverse_frequencies` computes the per-pair frequencies exactly as transformers does (fp32), scaled as
   model.rope_scaling's variant says (`llama3`, `yarn`, `linear`; `dynamic` is the default within the positions
   served), or divided by per-frequency factors (a GGUF's `rope_freqs` tensor, which is how llama.cpp files carry
   Llama 3.1 scaling).
2. `RopeCache` precomputes cos and a sign-folded sin for every position once, in the model dtype, both times the
   scaling's cos/sin scale (YaRN's attention factor; 1 otherwise).
3. `RopeCache.lookup(positions)` and `apply_rope` rotate q and k together per forward.
"""

from __future__ import annotations

import math

import torch

from mooncaked.model.rope_scaling import Llama3Scaling, LinearScaling, RopeScaling, YarnScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                        freq_factors: tuple[float, ...] | None = None) -> torch.Tensor:
    """[head_dim // 2] fp32 frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    if isinstance(scaling, Llama3Scaling):
        return _llama3_scale(inv_freq, scaling)
    if isinstance(scaling, YarnScaling):
        return _yarn_scale(head_dim, theta, scaling)
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
    return inv_freq  # default, and dynamic within max_position_embeddings


def cos_sin_scale(scaling: RopeScaling | None) -> float:
    """What transformers multiplies cos and sin by (its `attention_scaling`)."""
    return scaling.cos_sin_scale if isinstance(scaling, YarnScaling) else 1.0


def _llama3_scale(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_scale(dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: extrapolated frequencies (fast rotations) ramped into interpolated
    ones (slow rotations) over the dimensions between beta_fast and beta_slow rotations."""
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


class RopeCache:
    """cos/sin tables for positions 0..max_positions-1; immutable after construction (owned by the model)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int,
                 dtype: torch.dtype, device: torch.device | str, freq_factors: tuple[float, ...] | None = None) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling, freq_factors)
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], the same fp32 products transformers forms
        scale = cos_sin_scale(scaling)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale  # [P, D/2] each
        self.max_positions = max_positions
        self.cos = torch.cat([cos, cos], dim=-1).to(dtype=dtype, device=device)  # [P, D]
        # sin with rotate_half's sign folded in: rotate_half(x) * sin == swap_halves(x) * signed_sin
        self.signed_sin = torch.cat([-sin, sin], dim=-1).to(dtype=dtype, device=device)  # [P, D]

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
