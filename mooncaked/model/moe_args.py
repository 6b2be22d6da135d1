"""Hyperparameters of a Mixture-of-Experts MLP (MoEArgs), shared by the MoE families (Qwen3-MoE, DeepSeek-V3).

1. model.families reads them from `config.json` (num_experts / n_routed_experts, num_experts_per_tok,
   moe_intermediate_size, the router switches) and names the layers whose MLP is sparse.
2. Validation in `__post_init__` raises ValueError naming the Hugging Face field (the loader reports it as a
   ConfigError of config.json).
3. ModelArgs.moe holds them (None: a dense model); model.moe builds the sparse MLP, model.moe_routing routes.

Router variants, as switches:
- `scoring="softmax"` (Qwen3-MoE): top-k of softmax(logits), renormalized over the k with `norm_topk_prob`.
- `scoring="sigmoid"` (DeepSeek-V3): sigmoid(logits); the choice adds `e_score_correction_bias` and, with
  `num_groups` > 1, keeps only the `num_groups_per_token` groups whose two best scores sum highest; the weights
  are the chosen experts' sigmoid scores (renormalized with `norm_topk_prob`) times `routed_scaling_factor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCORINGS = ("softmax", "sigmoid")
MAX_EXPERTS = 8192  # DeepSeek-V3 has 256 routed experts, Kimi K2 384: a larger count is a damaged config.json


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int  # routed experts (num_experts / n_routed_experts)
    num_experts_per_token: int  # top-k (num_experts_per_tok)
    intermediate_size: int  # one expert's MLP width (moe_intermediate_size)
    sparse_layers: tuple[int, ...]  # layers whose MLP is this MoE; the others are dense (ModelArgs.intermediate_size)
    scoring: str = "softmax"  # one of SCORINGS
    norm_topk_prob: bool = False
    num_groups: int = 1  # n_group: experts in equal groups for group-limited routing (sigmoid scoring)
    num_groups_per_token: int = 1  # topk_group: groups a token's experts may come from
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False  # e_score_correction_bias added to the scores used for the choice
    num_shared_experts: int = 0  # n_shared_experts: a dense MLP of num_shared * intermediate_size beside the experts

    def __post_init__(self) -> None:
        for name, field in (("num_experts", self.num_experts), ("num_experts_per_tok", self.num_experts_per_token),
                            ("moe_intermediate_size", self.intermediate_size), ("n_group", self.num_groups),
                            ("topk_group", self.num_groups_per_token)):
            if field <= 0:
                raise ValueError(f"model config: {name} must be positive, got {field}")
        if self.num_experts > MAX_EXPERTS:
            raise ValueError(f"model config: num_experts ({self.num_experts}) exceeds {MAX_EXPERTS}")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok ({self.num_experts_per_token}) exceeds the number of "
                             f"experts ({self.num_experts})")
        if self.scoring not in SCORINGS:
            raise ValueError(f"model config: MoE scoring {self.scoring!r} is not one of {', '.join(SCORINGS)}")
        if self.num_shared_experts < 0:
            raise ValueError(f"model config: n_shared_experts must be >= 0, got {self.num_shared_experts}")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(f"model config: routed_scaling_factor must be a positive finite number, got "
                             f"{self.routed_scaling_factor}")
        if len(set(self.sparse_layers)) != len(self.sparse_layers) or any(i < 0 for i in self.sparse_layers):
            raise ValueError(f"model config: MoE layers {self.sparse_layers} must be distinct layer indices")
        self._check_groups()

    def _check_groups(self) -> None:
        if self.num_groups_per_token > self.num_groups:
            raise ValueError(f"model config: topk_group ({self.num_groups_per_token}) exceeds n_group "
                             f"({self.num_groups}); a token cannot pick more expert groups than there are")
        if self.num_experts % self.num_groups != 0:
            raise ValueError(f"model config: n_group ({self.num_groups}) does not divide the {self.num_experts} "
                             "experts into equal groups")
        experts_per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and experts_per_group < 2:
            raise ValueError(f"model config: n_group ({self.num_groups}) leaves fewer than 2 experts per group; a "
                             "group's score is the sum of its two best experts")
        if self.num_experts_per_token > self.num_groups_per_token * experts_per_group:
            raise ValueError(f"model config: num_experts_per_tok ({self.num_experts_per_token}) exceeds the experts "
                             f"of topk_group ({self.num_groups_per_token}) groups of {experts_per_group}")
        if self.num_groups > 1 and self.scoring != "sigmoid":
            raise ValueError("model config: group-limited routing (n_group > 1) needs sigmoid scoring")

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.intermediate_size

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx in self.sparse_layers
