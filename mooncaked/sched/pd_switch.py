"""Which instance to switch between prefill and decode, and when: a switch must pay for itself.

1. Every control period the owner calls `observe(prefill_load, decode_load)` with each pool's measured load
   (1.0 = at its SLO; None for a pool with no ready instance) and then `plan(candidates, now)`. Each pool's load
   is the trimmed mean of its last `window` samples (`pd_ratio.trimmed_mean`): one noisy sample moves nothing.
2. `plan` asks, for each direction, what moving one switchable instance gains (sched/pd_gain.py: the pools'
   demand beyond their scale-out load, in instances, before and after) and weighs it over `horizon_s` against
   what that instance's switch costs: its drain and re-registration as measured at its earlier switches in the
   same direction (else in the other, else `default_switch_cost_s`), and at least the drain of the work it holds
   now (`drain_s`, which the instance predicts: a decode instance's running sequences until their predicted ends,
   a prefill instance's queue). A direction is wanted when the gain exceeds `gain_margin` x the cost and the pools'
   imbalance factor (sched/pd_ratio.py) is outside the tolerance band, unless the hot pool's load is already
   falling (the newer half of its window `falling_fraction` below the older half: a backlog draining).
3. Hysteresis: a wanted direction must persist for `num_confirm` periods and at least as long as its switch
   costs, and after a switch nothing switches for `dwell_s` or `dwell_per_cost` x that switch's cost, whichever
   is longer. Reversing the last switch needs `reversal_factor` times the margin and the persistence: the
   opposite imbalance must hold, not one sample.
4. The owner applies the returned `SwitchPlan` and calls `switched(name, now, cost_s)` with what the switch took
   (success or not): the windows are cleared, since the loads they hold describe the pools before the switch.

Pure policy over plain data with `now` passed in; the conductor's leader (roles/conductor/leader.py), the
simulator's P/D study (sim/pd_study.py) and tests drive the same code.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from mooncaked.sched.pd_gain import switch_gain
from mooncaked.sched.pd_ratio import PdDecision, PdRatioConfig, imbalance_factor, is_balanced, trimmed_mean


@dataclass(frozen=True)
class SwitchPolicy:
    """The planner's knobs (the `pd_controller` section): the ratio's band and loads, the window, persistence,
    dwell, and the cost-benefit test."""

    ratio: PdRatioConfig
    window: int = 10
    num_confirm: int = 3
    dwell_s: float = 10.0
    interval_s: float = 1.0  # the control period: what one observation stands for
    horizon_s: float = 60.0
    gain_margin: float = 2.0
    default_switch_cost_s: float = 5.0
    dwell_per_cost: float = 3.0
    reversal_factor: float = 2.0
    falling_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.window < 1 or self.num_confirm < 1 or self.dwell_s < 0 or self.interval_s <= 0:
            raise ValueError("window and num_confirm must be >= 1, dwell_s >= 0 and interval_s > 0")
        if self.horizon_s <= 0 or self.gain_margin < 0 or self.default_switch_cost_s < 0:
            raise ValueError("horizon_s must be > 0, gain_margin and default_switch_cost_s >= 0")
        if self.dwell_per_cost < 0 or self.reversal_factor < 1 or not 0 <= self.falling_fraction < 1:
            raise ValueError("dwell_per_cost must be >= 0, reversal_factor >= 1, falling_fraction in [0, 1)")


@dataclass(frozen=True)
class SwitchCandidate:
    name: str
    role: str  # "prefill" | "decode"
    is_switchable: bool
    is_ready: bool
    load: float  # its own load; the least loaded instance of the colder side switches
    last_switch_at: float | None  # None: never switched
    drain_s: float = 0.0  # predicted seconds until the work it holds now is done (its drain, were it to switch)


@dataclass(frozen=True)
class SwitchPlan:
    name: str
    from_role: str
    to_role: str
    decision: PdDecision
    gain: float  # instances' worth of demand brought within its SLO
    cost_s: float  # the chosen instance's expected switch time


class SwitchPlanner:
    """Owns the load windows, the hysteresis state (the wanted direction and since when, the last switch) and
    every instance's measured switch cost."""

    def __init__(self, policy: SwitchPolicy) -> None:
        self.policy = policy
        self.prefill_loads: deque[float] = deque(maxlen=policy.window)
        self.decode_loads: deque[float] = deque(maxlen=policy.window)
        self.last_decision: PdDecision | None = None
        self.last_gain = 0.0
        self.cost_s: dict[tuple[str, str], float] = {}  # measured switch time per (instance, from role), smoothed
        self._pending = ""  # the direction wanted in the previous periods ("prefill": an instance leaves prefill)
        self._num_pending = 0
        self._last_switch_at: float | None = None
        self._last_switch_cost_s = 0.0
        self._last_from_role = ""

    def observe(self, prefill_load: float | None, decode_load: float | None) -> None:
        if prefill_load is not None:
            self.prefill_loads.append(prefill_load)
        if decode_load is not None:
            self.decode_loads.append(decode_load)

    def measured_costs(self) -> dict[str, float]:
        """The measured switch times as "instance from role" -> seconds (for reports: JSON keys are strings)."""
        return {f"{name} from {role}": cost_s for (name, role), cost_s in self.cost_s.items()}

    def cost_of(self, candidate: SwitchCandidate) -> float:
        """What switching `candidate` out of its role is expected to take: its measured switch time in that
        direction (else the default), and no less than the drain of the work it holds now."""
        other_way = self.cost_s.get((candidate.name, "decode" if candidate.role == "prefill" else "prefill"))
        measured = self.cost_s.get((candidate.name, candidate.role), other_way)
        return max(self.policy.default_switch_cost_s if measured is None else measured, candidate.drain_s)

    def plan(self, candidates: list[SwitchCandidate], now: float) -> SwitchPlan | None:
        policy, ratio = self.policy, self.policy.ratio
        num_prefill = sum(1 for c in candidates if c.role == "prefill")
        num_decode = sum(1 for c in candidates if c.role == "decode")
        if not self.decode_loads or (num_prefill and not self.prefill_loads):
            return None
        prefill_load = trimmed_mean(self.prefill_loads, ratio.trim_fraction)
        decode_load = trimmed_mean(self.decode_loads, ratio.trim_fraction)
        factor = imbalance_factor(self.prefill_loads, self.decode_loads, ratio.trim_fraction)
        from_role = "prefill" if factor > 1.0 else "decode"
        num_from = num_prefill if from_role == "prefill" else num_decode
        movable = [c for c in candidates if c.role == from_role and c.is_switchable and c.is_ready
                   and self._has_dwelt(c.last_switch_at, now, policy.dwell_s)]
        chosen = min(movable, key=lambda c: (c.load, c.name)) if movable else None
        gain = 0.0
        if num_from > ratio.min_per_side and not is_balanced(factor, ratio.tolerance):
            gain = switch_gain(prefill_load, decode_load, num_prefill, num_decode, from_role, ratio.scale_out_load)
        cost_s = self.cost_of(chosen) if chosen is not None else policy.default_switch_cost_s
        is_reversal = from_role != self._last_from_role and self._last_from_role != ""
        strictness = policy.reversal_factor if is_reversal else 1.0
        is_worth_it = gain > 0 and gain * policy.horizon_s > strictness * policy.gain_margin * cost_s
        hot_loads = self.decode_loads if from_role == "prefill" else self.prefill_loads
        wanted = from_role if is_worth_it and not _is_falling(hot_loads, policy.falling_fraction) else ""
        self.last_gain = gain
        self.last_decision = _decision(wanted, factor)
        if wanted != self._pending:
            self._pending, self._num_pending = wanted, 0
        if not wanted or chosen is None:
            return None
        self._num_pending += 1
        num_needed = math.ceil(strictness * max(policy.num_confirm, cost_s / policy.interval_s))
        dwell_s = max(policy.dwell_s, policy.dwell_per_cost * self._last_switch_cost_s)
        if self._num_pending < num_needed or not self._has_dwelt(self._last_switch_at, now, dwell_s):
            return None
        to_role = "decode" if from_role == "prefill" else "prefill"
        return SwitchPlan(chosen.name, from_role, to_role, self.last_decision, gain, cost_s)

    def switched(self, name: str, now: float, cost_s: float | None = None, from_role: str = "") -> None:
        """A switch was tried at `now` and took `cost_s` (None: not measured; kept as expected)."""
        key = (name, from_role or self._last_from_role)
        if cost_s is not None:
            previous = self.cost_s.get(key)
            self.cost_s[key] = cost_s if previous is None else (previous + cost_s) / 2
        self._last_switch_at = now
        self._last_switch_cost_s = self.cost_s.get(key, self.policy.default_switch_cost_s)
        self._last_from_role = from_role or self._last_from_role
        self.reset()

    def reset(self) -> None:
        """Forget the samples and the wanted direction (after a switch, or when a new leader takes over)."""
        self._pending, self._num_pending = "", 0
        self.prefill_loads.clear()
        self.decode_loads.clear()

    @staticmethod
    def _has_dwelt(since: float | None, now: float, dwell_s: float) -> bool:
        return since is None or now - since >= dwell_s


def _is_falling(loads: deque[float], fraction: float) -> bool:
    """The newer half of the window is below the older half by more than `fraction`: the hot pool is already
    catching up (a backlog draining after the last switch), so another instance would come too late."""
    if len(loads) < 4:
        return False
    samples = list(loads)
    half = len(samples) // 2
    older, newer = samples[:half], samples[len(samples) - half:]
    return sum(newer) / len(newer) < (1.0 - fraction) * sum(older) / len(older)


def _decision(from_role: str, factor: float) -> PdDecision:
    """The planner's decision as the ratio controller reports one (a switch: -1 on one side, +1 on the other)."""
    if from_role == "prefill":
        return PdDecision(-1, 1, factor, "move_prefill_to_decode")
    if from_role == "decode":
        return PdDecision(1, -1, factor, "move_decode_to_prefill")
    return PdDecision(0, 0, factor, "hold")
