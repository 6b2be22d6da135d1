"""Llama-family hyperparameters (ModelArgs) and where they come from.

1. A Hugging Face `config.json` (`ModelArgs.from_hf_config`), GGUF metadata (`ModelArgs.from_gguf_metadata`)
   or a named preset for seeded random models (`random_preset`).
2. Validation in `__post_init__`: shapes that cannot form a Llama raise ValueError naming the field.
3. The frozen ModelArgs is then read by the modules, the weight loaders and the engine (KV page shapes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`); other types are rejected at parse time."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        """From a Hugging Face LlamaConfig-style dict (`config.json`)."""
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(config)),
            rope_scaling=parse_rope_scaling(config.get("rope_scaling") or config.get("rope_parameters")),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, has_output_tensor: bool) -> ModelArgs:
        """From GGUF key/values of a `llama` architecture file."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama'")
        hidden_size = int(meta["llama.embedding_length"])
        num_heads = int(meta["llama.attention.head_count"])
        head_dim = int(meta.get("llama.rope.dimension_count", hidden_size // num_heads))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        tokens = meta.get("tokenizer.ggml.tokens") or ()
        return cls(
            vocab_size=int(meta.get("llama.vocab_size", len(tokens))),
            hidden_size=hidden_size,
            intermediate_size=int(meta["llama.feed_forward_length"]),
            num_layers=int(meta["llama.block_count"]),
            num_heads=num_heads,
            num_kv_heads=int(meta.get("llama.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            rope_scaling=None,
            max_position_embeddings=int(meta.get("llama.context_length", 2048)),
            tie_word_embeddings=not has_output_tensor,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent `config.json` dict (used to compare against transformers in tests)."""
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.rope_scaling is not None:
            s = self.rope_scaling
            config["rope_scaling"] = {
                "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        return config


def _rope_theta(config: Mapping[str, Any]) -> float:
    if "rope_theta" in config:
        return float(config["rope_theta"])
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0


def parse_rope_scaling(raw: Mapping[str, Any] | None) -> RopeScaling | None:
    """`rope_scaling` of a HF config; None and `default` mean no scaling; only `llama3` is implemented."""
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"model config: rope_scaling type {rope_type!r} is not supported (only 'llama3')")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


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
}


def random_preset(name: str, **overrides: Any) -> ModelArgs:
    """A named preset for `random:<name>` models, optionally with fields replaced."""
    if name not in _PRESETS:
        raise ValueError(f"unknown random model preset {name!r}; choose one of {sorted(_PRESETS)}")
    return replace(_PRESETS[name], **overrides)


def preset_names() -> list[str]:
    return sorted(_PRESETS)
