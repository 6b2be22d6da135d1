"""GGUF metadata -> ModelArgs for the llama.cpp architectures `llama` (Llama 2/3, Mistral), `qwen2`, `qwen3`.

1. `general.architecture` picks the family; any other architecture is refused by name (UnsupportedModel).
2. Hyperparameters come from the `<arch>.*` keys, type-checked (ConfigError names the key); the per-family
   flags come from the tensors the file holds (q/k/v and output biases, an output head).
3. llama.cpp files carry Llama 3.1 RoPE scaling as a `rope_freqs` tensor of per-frequency divisors, which the
   caller reads and passes in. llama.cpp runs no sliding window for these architectures, and neither do we.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mooncaked.model.config import ModelArgs
from mooncaked.model.families import ConfigError, UnsupportedModel

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_FREQS = "rope_freqs.weight"
_MISSING = object()


def args_from_gguf(meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]],
                   rope_freq_factors: tuple[float, ...] | None) -> ModelArgs:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported; supported: llama (Llama 2/3, "
                               "Mistral), qwen2 (Qwen2/2.5), qwen3 (Qwen3 dense)")
    _refuse_rope_scaling(meta, arch)
    hidden_size = _int(meta, f"{arch}.embedding_length")
    num_heads = _int(meta, f"{arch}.attention.head_count")
    head_dim = _int(meta, f"{arch}.attention.key_length", None)
    if head_dim is None:
        if num_heads <= 0 or hidden_size % num_heads:
            raise ConfigError(f"GGUF: {arch}.embedding_length ({hidden_size}) is not a multiple of "
                              f"{arch}.attention.head_count ({num_heads}) and no key_length is given")
        head_dim = hidden_size // num_heads
    rope_dims = _int(meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim or _int(meta, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModel(f"GGUF: partial rotary ({rope_dims} of {head_dim} dims) or a value length unlike "
                               "the key length is not supported")
    embedding = tensor_shapes.get("token_embd.weight", (0,))
    try:
        return ModelArgs(
            vocab_size=_int(meta, f"{arch}.vocab_size", embedding[0]),
            hidden_size=hidden_size,
            intermediate_size=_int(meta, f"{arch}.feed_forward_length"),
            num_layers=_int(meta, f"{arch}.block_count"),
            num_heads=num_heads,
            num_kv_heads=_int(meta, f"{arch}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=_float(meta, f"{arch}.rope.freq_base", 10000.0),
            max_position_embeddings=_int(meta, f"{arch}.context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            bos_token_id=_int(meta, "tokenizer.ggml.bos_token_id", None),
            eos_token_ids=_eos_ids(meta),
            rope_freq_factors=rope_freq_factors,
            **_family_flags(arch, tensor_shapes),
        )
    except (ConfigError, UnsupportedModel):
        raise
    except ValueError as exc:
        raise ConfigError(f"GGUF: {exc}") from exc


def _family_flags(arch: str, tensor_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    has_qkv_bias = "blk.0.attn_q.bias" in tensor_shapes
    has_o_bias = "blk.0.attn_output.bias" in tensor_shapes
    if arch == "qwen2":
        return {"family": "qwen2", "qkv_bias": True}
    if arch == "llama" and has_qkv_bias != has_o_bias:
        raise UnsupportedModel("GGUF llama file with q/k/v biases but no output bias (or the reverse) is not "
                               "supported")
    return {"family": arch, "qkv_bias": has_qkv_bias, "o_bias": has_o_bias, "qk_norm": arch == "qwen3"}


def _refuse_rope_scaling(meta: Mapping[str, Any], arch: str) -> None:
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", 1.0)
    if scaling != "none" and factor != 1.0:
        raise UnsupportedModel(f"GGUF rope scaling type {scaling!r} (factor {factor}) is not supported; only "
                               "Llama 3 scaling through a rope_freqs tensor")


def _eos_ids(meta: Mapping[str, Any]) -> tuple[int, ...]:
    eos = _int(meta, "tokenizer.ggml.eos_token_id", None)
    return () if eos is None else (eos,)


def _int(meta: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    value = meta.get(key, default)
    if value is _MISSING:
        raise ConfigError(f"GGUF metadata has no {key!r}")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"GGUF metadata {key} must be an integer, got {value!r}")
    return value


def _float(meta: Mapping[str, Any], key: str, default: float) -> float:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"GGUF metadata {key} must be a number, got {value!r}")
    return float(value)
