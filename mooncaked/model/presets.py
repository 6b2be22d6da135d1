"""Named hyperparameters of seeded random models (`random:<name>` sources): tests and benchmarks.

1. `random_preset(name, **overrides)` returns the preset's ModelArgs, with fields replaced; the loader
   (model.loader) builds random weights for it (model.weight_names.random_hf_state_dict).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mooncaked.model.config import ModelArgs
from mooncaked.model.mla_args import MLAArgs
from mooncaked.model.moe_args import MoEArgs

# Random-weight presets for tests and benchmarks. Vocabulary 320 covers the 256 byte tokens plus specials of
# the byte-level test tokenizer (tokenizer.byte_level_test_tokenizer).
_PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=4096, bos_token_id=1,
                      eos_token_ids=(2,)),
    "small": ModelArgs(vocab_size=320, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                       num_kv_heads=2, head_dim=32, max_position_embeddings=8192, bos_token_id=1,
                       eos_token_ids=(2,)),
    "smollm2-135m": ModelArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                              num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                              max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                              eos_token_ids=(2,)),
    # SmolLM2-135M's size and shape with heads two ranks can split (8 query, 4 KV): tensor-parallel benchmarks
    "smollm2-135m-8q4kv": ModelArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                    num_heads=8, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5,
                                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                                    bos_token_id=1, eos_token_ids=(2,)),
    # `bench model --model moe`: Qwen3-MoE-shaped (experts 0.375 x hidden wide, as Qwen3-30B-A3B's 768 / 2048),
    # 16 experts of 192 columns, top-4 renormalized, every layer sparse; and a dense model of the same active
    # parameters (one MLP of 4 x 192 columns)
    "moe-512": ModelArgs(vocab_size=320, hidden_size=512, intermediate_size=768, num_layers=4, num_heads=8,
                         num_kv_heads=4, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_ids=(2,), family="qwen3_moe", qk_norm=True,
                         moe=MoEArgs(num_experts=16, num_experts_per_token=4, intermediate_size=192,
                                     sparse_layers=(0, 1, 2, 3), norm_topk_prob=True)),
    # DeepSeek-V3's latent attention, tiny and dense: a 32-wide latent and an 8-wide rope key cached per token
    "tiny-mla": ModelArgs(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=1, head_dim=24, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
                          family="deepseek_v3", mla=MLAArgs(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                                            v_head_dim=16)),
    "moe-512-dense": ModelArgs(vocab_size=320, hidden_size=512, intermediate_size=768, num_layers=4, num_heads=8,
                               num_kv_heads=4, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=4096,
                               bos_token_id=1, eos_token_ids=(2,), family="qwen3", qk_norm=True),
}


def random_preset(name: str, **overrides: Any) -> ModelArgs:
    """A named preset for `random:<name>` models, optionally with fields replaced."""
    if name not in _PRESETS:
        raise ValueError(f"unknown random model preset {name!r}; choose one of {sorted(_PRESETS)}")
    return replace(_PRESETS[name], **overrides)
