"""Hyperparameters of the supported decoder families (ModelArgs) and the slice of them one device holds.

1. ModelArgs come from a Hugging Face `config.json` (model.families), GGUF metadata (model.weights_gguf) or a
   named preset for seeded random models (model.presets).
2. Validation in `__post_init__`: shapes that cannot form the model raise ValueError naming the field.
3. The frozen ModelArgs is read by the modules, the weight loaders and the engine (KV page shapes); the
   modules take their head and column counts from a ShardShape (`ShardShape.whole(args)` on one device).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mooncaked.model.moe_args import MoEArgs
from mooncaked.model.rope_scaling import DynamicScaling, Llama3Scaling, LinearScaling, RopeScaling, YarnScaling

# Hugging Face model_type of each supported family (model.families holds their differences).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


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
    family: str = "llama"  # one of FAMILIES: the Hugging Face model_type
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; attention_bias in Llama and Qwen3)
    o_bias: bool = False  # o_proj carries a bias (attention_bias in Llama and Qwen3)
    mlp_bias: bool = False  # gate/up/down carry biases (Llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # keys a query sees in windowed layers (itself included); None: all
    full_attention_layers: tuple[int, ...] = ()  # layers exempt from sliding_window (Qwen's max_window_layers)
    rope_freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (a GGUF's rope_freqs tensor)
    moe: MoEArgs | None = None  # the sparse MLP of the layers moe.sparse_layers names (Qwen3-MoE); None: all dense

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
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"model config: {name} must be a positive finite number, got {value}")
        if self.family not in FAMILIES:
            raise ValueError(f"model config: family {self.family!r} is not one of {', '.join(FAMILIES)}")
        self._check_token_ids()
        self._check_window()
        if not _FAMILY_RULES[self.family](self):
            raise ValueError(f"model config: a {self.family} model cannot have qkv_bias={self.qkv_bias}, "
                             f"o_bias={self.o_bias}, mlp_bias={self.mlp_bias}, qk_norm={self.qk_norm}, "
                             f"sliding_window={self.sliding_window}, full_attention_layers="
                             f"{self.full_attention_layers}, moe={self.moe}")
        if self.rope_freq_factors is not None and (len(self.rope_freq_factors) != self.head_dim // 2 or not all(
                math.isfinite(f) and f > 0 for f in self.rope_freq_factors)):
            raise ValueError(f"model config: rope_freq_factors must be {self.head_dim // 2} positive numbers")

    def _check_token_ids(self) -> None:
        for token_id in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"model config: special token id {token_id} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def _check_window(self) -> None:
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"model config: sliding_window must be positive, got {self.sliding_window}")
        if any(not 0 <= i < self.num_layers for i in self.full_attention_layers):
            raise ValueError(f"model config: full_attention_layers {self.full_attention_layers} must be layer "
                             f"indices below num_layers ({self.num_layers})")
        if self.moe is not None and any(i >= self.num_layers for i in self.moe.sparse_layers):
            raise ValueError(f"model config: MoE layers {self.moe.sparse_layers} must be below num_layers "
                             f"({self.num_layers})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_kv_planes(self) -> int:
        """Tensors the KV cache holds per layer: K and V."""
        return 2

    @property
    def kv_head_dim(self) -> int:
        """Width of one KV head in the cache."""
        return self.head_dim

    @property
    def rope_head_dim(self) -> int:
        """Dimensions RoPE rotates per head (the cos/sin tables' width)."""
        return self.head_dim

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes of one token over every layer and KV head (what a store object holds per token)."""
        return self.num_layers * self.num_kv_planes * self.num_kv_heads * self.kv_head_dim * itemsize

    @property
    def context_length(self) -> int:
        """Positions the model serves: max_position_embeddings, or YaRN's extended context where that is longer
        (Qwen2.5/Qwen3 long-context configs keep max_position_embeddings at the original length)."""
        s = self.rope_scaling
        if isinstance(s, YarnScaling):
            return max(self.max_position_embeddings, int(s.factor * s.original_max_position_embeddings))
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of layer `layer_idx` (None: it sees every earlier token)."""
        return None if layer_idx in self.full_attention_layers else self.sliding_window

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent `config.json` dict of this family (tests and benchmarks compare with transformers)."""
        config: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.family]], "model_type": self.family,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        config.update(self._hf_family_options())
        if self.rope_scaling is not None:
            config["rope_scaling"] = _hf_rope_scaling(self.rope_scaling)
        return config

    def _hf_family_options(self) -> dict[str, Any]:
        if self.family == "llama":
            return {"attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias}
        if self.family == "mistral":
            return {"sliding_window": self.sliding_window}
        layer_types = ["full_attention" if self.layer_sliding_window(i) is None else "sliding_attention"
                       for i in range(self.num_layers)]
        options: dict[str, Any] = {"use_sliding_window": self.sliding_window is not None,
                                   "sliding_window": self.sliding_window, "layer_types": layer_types}
        if self.family in ("qwen3", "qwen3_moe"):
            options["attention_bias"] = self.qkv_bias
        if self.moe is not None:
            options.update(_hf_moe_options(self.moe, self.num_layers))
        return options


def _hf_rope_scaling(s: RopeScaling) -> dict[str, Any]:
    if isinstance(s, Llama3Scaling):
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    if isinstance(s, YarnScaling):
        optional = {"mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim, "attention_factor": s.attention_factor}
        return {"rope_type": "yarn", "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings, "beta_fast": s.beta_fast,
                "beta_slow": s.beta_slow, "truncate": s.truncate,
                **{key: value for key, value in optional.items() if value is not None}}
    rope_type = "linear" if isinstance(s, LinearScaling) else "dynamic"
    assert isinstance(s, (LinearScaling, DynamicScaling))
    return {"rope_type": rope_type, "factor": s.factor}


def _hf_moe_options(moe: MoEArgs, num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's fields for `moe` (sparse layers given as mlp_only_layers, the complement)."""
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_token,
            "moe_intermediate_size": moe.intermediate_size, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(num_layers) if not moe.is_sparse(i)]}


# What each family's transformers class can express (so to_hf_config is exact).
_FAMILY_RULES: dict[str, Callable[[ModelArgs], bool]] = {
    "llama": lambda a: a.o_bias == a.qkv_bias and not a.qk_norm and a.sliding_window is None and a.moe is None,
    "mistral": lambda a: not (a.qkv_bias or a.o_bias or a.mlp_bias or a.qk_norm or a.full_attention_layers
                              or a.moe),
    "qwen2": lambda a: a.qkv_bias and not (a.o_bias or a.mlp_bias or a.qk_norm or a.moe),
    "qwen3": lambda a: a.qk_norm and a.o_bias == a.qkv_bias and not a.mlp_bias and a.moe is None,
    "qwen3_moe": lambda a: a.qk_norm and a.o_bias == a.qkv_bias and not a.mlp_bias and a.moe is not None and (
        a.moe.scoring == "softmax" and a.moe.num_groups == 1 and a.moe.num_shared_experts == 0
        and a.moe.routed_scaling_factor == 1.0 and not a.moe.has_correction_bias),
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class ShardShape:
    """The part of every layer one device holds: query heads, KV heads and MLP columns, with where they start
    in the checkpoint's tensors. On one device it is the whole layer; tensor parallelism gives each rank a slice
    (model.tensor_parallel.shard_shape).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    head_offset: int = 0  # first query head of this shard
    kv_head_offset: int = 0  # first KV head of this shard
    intermediate_offset: int = 0  # first MLP column of this shard
    rank: int = 0  # tensor-parallel rank holding this shard (model.tensor_parallel)
    vocab_size: int | None = None  # output head rows of this shard; None: every one (not split)
    vocab_offset: int = 0  # first output head row of this shard
    num_ranks: int = 1  # ranks the layer is split across; > 1: row-parallel outputs are all-reduced
    num_experts: int = 0  # routed experts this shard holds (MoE layers)
    expert_offset: int = 0  # first of them
    expert_intermediate_size: int = 0  # columns of each held expert's MLP
    expert_intermediate_offset: int = 0
    shared_intermediate_size: int = 0  # columns of the shared experts' MLP
    shared_intermediate_offset: int = 0
    is_expert_parallel: bool = False  # experts partitioned across the ranks (else column-sharded)

    @classmethod
    def whole(cls, args: ModelArgs) -> ShardShape:
        moe = args.moe
        return cls(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                   intermediate_size=args.intermediate_size, num_experts=moe.num_experts if moe else 0,
                   expert_intermediate_size=moe.intermediate_size if moe else 0,
                   shared_intermediate_size=moe.shared_intermediate_size if moe else 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class LayerRange:
    """Layers [start, end) of a model with `num_layers` layers: what one pipeline stage of a prefill group holds
    (the first stage also the embedding, the last the final norm and output head); the whole model by default."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(f"layer range [{self.start}, {self.end}) is not within the model's {self.num_layers} "
                             "layers (or is empty)")

    @classmethod
    def whole(cls, args: ModelArgs) -> LayerRange:
        return cls(0, args.num_layers, args.num_layers)

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def has_embedding(self) -> bool:
        return self.start == 0

    @property
    def has_head(self) -> bool:
        return self.end == self.num_layers

    @property
    def is_whole(self) -> bool:
        return self.has_embedding and self.has_head


def split_layers(num_layers: int, num_stages: int, splits: list[int] | None = None) -> list[LayerRange]:
    """The stages' layer ranges: `splits` (the first layer of stages 1..) or an even split (earlier stages take
    the extra layers); ValueError when they do not give every stage at least one layer."""
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    if not splits:
        base, extra = divmod(num_layers, num_stages)
        splits = [sum(base + (i < extra) for i in range(stage)) for stage in range(1, num_stages)]
    if len(splits) != num_stages - 1:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} layer splits, got {splits}")
    bounds = [0, *splits, num_layers]
    return [LayerRange(bounds[i], bounds[i + 1], num_layers) for i in range(num_stages)]
