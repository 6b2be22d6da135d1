"""RoPE frequencies (with Llama-3 scaling) equal transformers' and the rotation matches rotate_half."""

from __future__ import annotations

import pytest
import torch

from mooncaked.model.config import RopeScaling, random_preset
from mooncaked.model.rope import RopeCache, apply_rope, inverse_frequencies


def test_llama3_scaled_frequencies_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    args = random_preset("small", rope_theta=500000.0, rope_scaling=scaling, head_dim=128, num_heads=2)
    config = transformers.LlamaConfig(**args.to_hf_config())
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(inverse_frequencies(128, 500000.0, scaling), expected, atol=0, rtol=1e-6)


def test_apply_rope_equals_rotate_half_formula() -> None:
    cache = RopeCache(16, 10000.0, None, 64, torch.float32, "cpu")
    x = torch.randn(5, 3, 16)
    positions = torch.tensor([0, 1, 7, 30, 63])
    cos, sin = cache.lookup(positions)
    inv = inverse_frequencies(16, 10000.0, None)
    angles = positions[:, None].float() * inv[None, :]
    c = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    s = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    rotate_half = torch.cat([-x[..., 8:], x[..., :8]], -1)
    torch.testing.assert_close(apply_rope(x, cos, sin), x * c + rotate_half * s)
