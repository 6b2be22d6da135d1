"""RoPE scaling variants a config.json may name (`rope_scaling` / `rope_parameters`), as frozen values.

1. model.families parses `rope_type` into one of these (`default` into None); model.gguf_args reads Llama 3.1
   scaling from a GGUF. What no class here covers (`longrope`, ...) is refused there by name.
2. Validation in `__post_init__` raises ValueError naming the field (reported as a ConfigError of config.json).
3. model.rope turns them into inverse frequencies and a cos/sin scale, as transformers' ROPE_INIT_FUNCTIONS do.

- Llama3Scaling (`llama3`): low frequencies divided by `factor`, a smooth band between.
- YarnScaling (`yarn`): frequencies ramped between interpolated (/ factor) and extrapolated ones over the
  dimensions `beta_fast` / `beta_slow` rotations bound at `original_max_position_embeddings`; cos and sin scaled
  by the attention factor (`attention_factor`, else from `mscale` / `mscale_all_dim`, else 0.1 ln(factor) + 1).
- LinearScaling (`linear`): every frequency divided by `factor`.
- DynamicScaling (`dynamic`, NTK): transformers raises the base only for sequences longer than
  `max_position_embeddings`; the model serves at most that many positions, where it equals the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_finite_positive(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"model config: rope scaling {name} must be a positive finite number, got {value}")


@dataclass(frozen=True)
class Llama3Scaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(f"model config: llama3 rope scaling needs factor > 0 and 0 < low_freq_factor < "
                             f"high_freq_factor, got {self}")
        if not (self.original_max_position_embeddings > 0 and all(map(math.isfinite, (
                self.factor, self.low_freq_factor, self.high_freq_factor)))):
            raise ValueError(f"model config: llama3 rope scaling needs finite factors and "
                             f"original_max_position_embeddings > 0, got {self}")


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit cos/sin scale; None: derived from factor and the mscales
    truncate: bool = True  # round the ramp's bounds to whole dimensions

    def __post_init__(self) -> None:
        _check_finite_positive(factor=self.factor, beta_fast=self.beta_fast, beta_slow=self.beta_slow)
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"model config: yarn rope scaling needs original_max_position_embeddings > 0, got "
                             f"{self.original_max_position_embeddings}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"model config: rope scaling {name} must be a finite number >= 0, got {value}")

    @property
    def cos_sin_scale(self) -> float:
        """transformers' attention_factor: cos and sin (so q and k) are multiplied by it."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times longer (DeepSeek-V3 also scales its softmax by its
    square with mscale_all_dim)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class LinearScaling:
    factor: float

    def __post_init__(self) -> None:
        _check_finite_positive(factor=self.factor)


@dataclass(frozen=True)
class DynamicScaling:
    factor: float

    def __post_init__(self) -> None:
        _check_finite_positive(factor=self.factor)


RopeScaling = Llama3Scaling | YarnScaling | LinearScaling | DynamicScaling
