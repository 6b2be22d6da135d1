"""Dynamic P/D ratio controller (paper section 5.1).

1. The owner samples the prefill and decode pool loads periodically (load = predicted TTFT / TTFT SLO and
   predicted TBT / TBT SLO, 1.0 = at the SLO) and keeps a window of recent samples.
2. Every control period it calls `decide(prefill_samples, decode_samples, num_prefill, num_decode, config)`:
   - the imbalance factor f = (trimmed mean decode load + 1) / (trimmed mean prefill load + 1), dropping the
     top and bottom `trim_fraction` of each window;
   - when the hotter side is above `scale_out_load` (the tide is rising), add instances to the hotter side;
   - when both sides are below `scale_in_load` (the tide is ebbing), remove instances from the colder side;
   - otherwise, when f leaves [1 / (1 + tolerance), 1 + tolerance], move instances from the colder to the
     hotter side;
   every step is at most `max_step` instances and respects the per-side minimum and the cluster maximum.
3. The owner applies the returned `PdDecision` (start, stop or switch instances) and keeps sampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PdRatioConfig:
    trim_fraction: float = 0.1
    tolerance: float = 0.2
    scale_out_load: float = 0.9
    scale_in_load: float = 0.3
    max_step: int = 1
    min_per_side: int = 1
    max_instances: int = 1_000_000

    def __post_init__(self) -> None:
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.tolerance < 0 or self.max_step < 1 or self.min_per_side < 0:
            raise ValueError("tolerance must be >= 0, max_step >= 1 and min_per_side >= 0")
        if self.scale_in_load >= self.scale_out_load:
            raise ValueError("scale_in_load must be below scale_out_load")


@dataclass(frozen=True)
class PdDecision:
    """Instances to add (positive) or remove (negative) per side; a switch is -1 on one side, +1 on the other."""

    delta_prefill: int
    delta_decode: int
    imbalance_factor: float
    reason: str


def trimmed_mean(samples: Sequence[float], trim_fraction: float) -> float:
    """Mean after dropping floor(trim_fraction * n) samples from each end; 0.0 for no samples."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    cut = int(math.floor(trim_fraction * len(ordered)))
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def is_balanced(factor: float, tolerance: float) -> bool:
    """f inside the hysteresis band [1 / (1 + tolerance), 1 + tolerance]."""
    return 1.0 / (1.0 + tolerance) <= factor <= 1.0 + tolerance


def imbalance_factor(prefill_samples: Sequence[float], decode_samples: Sequence[float], trim_fraction: float) -> float:
    """f_im = (L_decode + 1) / (L_prefill + 1) over trimmed means; > 1: decode is the hotter side."""
    decode_load = trimmed_mean(decode_samples, trim_fraction)
    prefill_load = trimmed_mean(prefill_samples, trim_fraction)
    return (decode_load + 1.0) / (prefill_load + 1.0)


def decide(
    prefill_samples: Sequence[float],
    decode_samples: Sequence[float],
    num_prefill: int,
    num_decode: int,
    config: PdRatioConfig,
) -> PdDecision:
    """One bounded control step; see the module docstring."""
    factor = imbalance_factor(prefill_samples, decode_samples, config.trim_fraction)
    prefill_load = trimmed_mean(prefill_samples, config.trim_fraction)
    decode_load = trimmed_mean(decode_samples, config.trim_fraction)
    decode_is_hotter = factor > 1.0
    step = _step_size(factor, config)
    total = num_prefill + num_decode
    if max(prefill_load, decode_load) > config.scale_out_load:
        num_added = min(step, max(config.max_instances - total, 0))
        if num_added:
            if decode_is_hotter:
                return PdDecision(0, num_added, factor, "scale_out_decode")
            return PdDecision(num_added, 0, factor, "scale_out_prefill")
    elif max(prefill_load, decode_load) < config.scale_in_load:
        colder_count = num_prefill if decode_is_hotter else num_decode
        num_removed = min(step, max(colder_count - config.min_per_side, 0))
        if num_removed:
            if decode_is_hotter:
                return PdDecision(-num_removed, 0, factor, "scale_in_prefill")
            return PdDecision(0, -num_removed, factor, "scale_in_decode")
        return PdDecision(0, 0, factor, "hold")
    if is_balanced(factor, config.tolerance):
        return PdDecision(0, 0, factor, "hold")
    colder_count = num_prefill if decode_is_hotter else num_decode
    num_moved = min(step, max(colder_count - config.min_per_side, 0))
    if not num_moved:
        return PdDecision(0, 0, factor, "hold")
    if decode_is_hotter:
        return PdDecision(-num_moved, num_moved, factor, "move_prefill_to_decode")
    return PdDecision(num_moved, -num_moved, factor, "move_decode_to_prefill")


def _step_size(factor: float, config: PdRatioConfig) -> int:
    """Grows with |log f| (one instance per ~10% of imbalance), capped at `max_step` to avoid overshoot."""
    if factor <= 0:
        return 1
    return max(1, min(config.max_step, math.ceil(abs(math.log(factor)) / math.log(1.1))))
