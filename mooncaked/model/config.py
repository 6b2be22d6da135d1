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

from mooncaked.model.mla_args import MLAArgs
from mooncaked.model.moe_args import MoEArgs
from mooncaked.model.rope_scaling import RopeScaling, YarnScaling, yarn_mscale

# Hugging Face model_type of each supported family (model.families holds their differences).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


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
    # Multi-head Latent Attention (DeepSeek-V3); then num_kv_heads is 1 (the latent) and head_dim the query/key
    # head's width (qk_nope_head_dim + qk_rope_head_dim)
    mla: MLAArgs | None = None
    num_mtp_layers: int = 0  # multi-token-prediction layers a checkpoint holds after the model's (not run)

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
                             f"{self.full_attention_layers}, moe={self.moe}, mla={self.mla}")
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
        if self.mla is not None and (self.num_kv_heads, self.head_dim) != (1, self.mla.qk_head_dim):
            raise ValueError(f"model config: an MLA model caches one latent (num_kv_heads 1, not {self.num_kv_heads}) "
                             f"and its heads are qk_nope_head_dim + qk_rope_head_dim = {self.mla.qk_head_dim} wide, "
                             f"not {self.head_dim}")
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
        """Tensors the KV cache holds per layer: K and V, or (MLA) one latent that is both."""
        return 1 if self.mla is not None else 2

    @property
    def kv_head_dim(self) -> int:
        """Width of one KV head in the cache (MLA: the latent and the rope key)."""
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    @property
    def rope_head_dim(self) -> int:
        """Dimensions RoPE rotates per head (the cos/sin tables' width)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale: 1 / sqrt(query head width), for MLA times YaRN's mscale(factor, mscale_all_dim)^2 as
        DeepSeek-V3 applies it."""
        scale = self.head_dim ** -0.5
        s = self.rope_scaling
        if self.mla is not None and isinstance(s, YarnScaling) and s.mscale_all_dim:
            scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale

    @property
    def kv_geometry(self) -> str:
        """The KV cache's layout per token, `layers x planes x KV heads x width` (part of the block keys' namespace)."""
        return f"{self.num_layers}x{self.num_kv_planes}x{self.num_kv_heads}x{self.kv_head_dim}"

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


# What each family's transformers class can express (so model.hf_config.to_hf_config is exact).
_FAMILY_RULES: dict[str, Callable[[ModelArgs], bool]] = {
    "llama": lambda a: (a.o_bias == a.qkv_bias and not a.qk_norm and a.sliding_window is None and a.moe is None
                        and a.mla is None),
    "mistral": lambda a: not (a.qkv_bias or a.o_bias or a.mlp_bias or a.qk_norm or a.full_attention_layers
                              or a.moe or a.mla),
    "qwen2": lambda a: a.qkv_bias and not (a.o_bias or a.mlp_bias or a.qk_norm or a.moe or a.mla),
    "qwen3": lambda a: a.qk_norm and a.o_bias == a.qkv_bias and not a.mlp_bias and a.moe is None and a.mla is None,
    "qwen3_moe": lambda a: a.qk_norm and a.o_bias == a.qkv_bias and not a.mlp_bias and a.moe is not None and (
        a.moe.scoring == "softmax" and a.moe.num_groups == 1 and a.moe.num_shared_experts == 0
        and a.moe.routed_scaling_factor == 1.0 and not a.moe.has_correction_bias) and a.mla is None,
    "deepseek_v3": lambda a: a.mla is not None and not (a.qkv_bias or a.o_bias or a.mlp_bias or a.qk_norm
                                                        or a.sliding_window) and (
        a.moe is None or (a.moe.scoring == "sigmoid" and a.moe.has_correction_bias
                          and a.moe.sparse_layers == tuple(range(min(a.moe.sparse_layers), a.num_layers)))),
}


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
