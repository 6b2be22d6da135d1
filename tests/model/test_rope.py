"""RoPE frequencies and cos/sin (Llama-3, YaRN, linear and dynamic scaling) equal transformers', and the rotation
matches rotate_half."""

from __future__ import annotations

import math

import pytest
import torch

from mooncaked.model.families import args_from_hf_config
from mooncaked.model.hf_config import to_hf_config
from mooncaked.model.presets import random_preset
from mooncaked.model.rope_scaling import Llama3Scaling, YarnScaling
from mooncaked.model.rope import RopeCache, apply_rope, inverse_frequencies


def test_llama3_scaled_frequencies_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    args = random_preset("small", rope_theta=500000.0, rope_scaling=scaling, head_dim=128, num_heads=2)
    config = transformers.LlamaConfig(**to_hf_config(args))
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


_ROPE_BASE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}
# Qwen2.5/Qwen3's long-context form, DeepSeek-V3's (mscales, betas, factor implied by the context lengths), an
# explicit attention factor with untruncated bounds, and the cheap ones
_SCALINGS = {
    "yarn-qwen": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-deepseek": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128, "mscale": 0.707,
                      "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-attention-factor-untruncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                          "attention_factor": 0.8, "truncate": False},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("scaling_id", list(_SCALINGS))
def test_scaled_rotary_embedding_equals_transformers(family: str, scaling_id: str) -> None:
    """cos and sin at every position the model serves, as each family's transformers rotary embedding computes
    them (YaRN's attention factor included)."""
    transformers = pytest.importorskip("transformers")
    rope = {**_SCALINGS[scaling_id], "rope_theta": 10000.0}
    config = transformers.AutoConfig.for_model(family, **_ROPE_BASE, rope_parameters=rope)
    args = args_from_hf_config(config.to_dict())
    assert type(args.rope_scaling).__name__.lower().startswith(rope["rope_type"])
    rotary = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    positions = torch.arange(args.max_position_embeddings)
    x = torch.zeros(1, positions.numel(), args.head_dim)
    expected_cos, expected_sin = (t[0] for t in rotary(x, positions[None]))
    cache = RopeCache(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings, torch.float32,
                      "cpu")
    cos, signed_sin = cache.lookup(positions)
    torch.testing.assert_close(cos[:, 0], expected_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(signed_sin[:, 0, args.head_dim // 2:], expected_sin[:, args.head_dim // 2:], atol=1e-6,
                               rtol=1e-6)
    assert args_from_hf_config(to_hf_config(args)) == args


def test_yarn_changes_frequencies_and_scale() -> None:
    """The YaRN cases above differ from the default rotation (so their equality is not vacuous)."""
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=64)
    default = inverse_frequencies(16, 10000.0, None)
    scaled = inverse_frequencies(16, 10000.0, yarn)
    assert torch.equal(scaled[:1], default[:1]) and not torch.allclose(scaled[-1], default[-1])
    assert yarn.cos_sin_scale == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_yarn_extends_the_served_context() -> None:
    """Qwen2.5's long-context recipe keeps max_position_embeddings at the original 32k and adds yarn x4: the model
    serves 128k positions."""
    config = {**_ROPE_BASE, "model_type": "qwen2", "max_position_embeddings": 32768,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    args = args_from_hf_config(config)
    assert args.context_length == 131072 and args.max_position_embeddings == 32768
    assert args_from_hf_config({**config, "rope_scaling": None}).context_length == 32768
