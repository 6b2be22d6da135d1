"""Which instance to switch between prefill and decode, and when: `pd_ratio.decide` with hysteresis and dwell.

1. Every control period the owner calls `observe(prefill_load, decode_load)` with each pool's measured load
   (1.0 = at its SLO; None for a pool with no ready instance) and then `plan(candidates, now)`.
2. `plan` asks `pd_ratio.decide` for a bounded step over the sample windows. Only switches are possible (no
   instance can be started or stopped here): moving an instance, or scaling out the hot side, becomes a switch
   of one switchable instance from the colder side; scaling in is a hold. A scale-out inside the tolerance band
   is a hold too: with both pools near or past their SLO, a switch only moves the bottleneck to the side it
   leaves (and the next period moves it back). Hysteresis: the ratio's tolerance band, then the same switch
   must be decided `num_confirm` periods in a row, and `dwell_s` must have passed since
   the last switch anywhere and since the chosen instance last switched.
3. The owner applies the returned `SwitchPlan` and calls `switched(name, now)` (success or not): the windows
   are cleared, since the loads they hold describe the pools before the switch.

Pure policy over plain data with `now` passed in; the conductor's leader (roles/conductor/leader.py) and tests
drive the same code.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mooncaked.sched.pd_ratio import PdDecision, PdRatioConfig, decide, is_balanced


@dataclass(frozen=True)
class SwitchCandidate:
    name: str
    role: str  # "prefill" | "decode"
    is_switchable: bool
    is_ready: bool
    load: float  # its own load; the least loaded instance of the colder side switches
    last_switch_at: float | None  # None: never switched


@dataclass(frozen=True)
class SwitchPlan:
    name: str
    from_role: str
    to_role: str
    decision: PdDecision


class SwitchPlanner:
    """Owns the load windows and the hysteresis state (the pending decision and its count, the last switch)."""

    def __init__(self, config: PdRatioConfig, window: int, num_confirm: int, dwell_s: float) -> None:
        if window < 1 or num_confirm < 1 or dwell_s < 0:
            raise ValueError("window and num_confirm must be >= 1, dwell_s >= 0")
        self.config = config
        self.num_confirm = num_confirm
        self.dwell_s = dwell_s
        self.prefill_loads: deque[float] = deque(maxlen=window)
        self.decode_loads: deque[float] = deque(maxlen=window)
        self.last_decision: PdDecision | None = None
        self._pending = ""  # the direction decided in the previous periods
        self._num_pending = 0
        self._last_switch_at: float | None = None

    def observe(self, prefill_load: float | None, decode_load: float | None) -> None:
        if prefill_load is not None:
            self.prefill_loads.append(prefill_load)
        if decode_load is not None:
            self.decode_loads.append(decode_load)

    def plan(self, candidates: list[SwitchCandidate], now: float) -> SwitchPlan | None:
        num_prefill = sum(1 for c in candidates if c.role == "prefill")
        num_decode = sum(1 for c in candidates if c.role == "decode")
        if not self.decode_loads or (num_prefill and not self.prefill_loads):
            return None
        decision = decide(list(self.prefill_loads), list(self.decode_loads), num_prefill, num_decode, self.config)
        self.last_decision = decision
        from_role = _from_role(decision, num_prefill, num_decode, self.config.min_per_side)
        if is_balanced(decision.imbalance_factor, self.config.tolerance):
            from_role = ""
        if from_role != self._pending:
            self._pending, self._num_pending = from_role, 0
        if not from_role:
            return None
        self._num_pending += 1
        if self._num_pending < self.num_confirm or not self._has_dwelt(self._last_switch_at, now):
            return None
        movable = [c for c in candidates if c.role == from_role and c.is_switchable and c.is_ready
                   and self._has_dwelt(c.last_switch_at, now)]
        if not movable:
            return None
        chosen = min(movable, key=lambda c: (c.load, c.name))
        return SwitchPlan(chosen.name, from_role, "decode" if from_role == "prefill" else "prefill", decision)

    def switched(self, name: str, now: float) -> None:
        self._last_switch_at = now
        self.reset()

    def reset(self) -> None:
        """Forget the samples and the pending decision (after a switch, or when a new leader takes over)."""
        self._pending, self._num_pending = "", 0
        self.prefill_loads.clear()
        self.decode_loads.clear()

    def _has_dwelt(self, since: float | None, now: float) -> bool:
        return since is None or now - since >= self.dwell_s


def _from_role(decision: PdDecision, num_prefill: int, num_decode: int, min_per_side: int) -> str:
    """The side an instance should leave ("" for none) for a decision that only switches can carry out."""
    if decision.delta_decode > 0 and decision.delta_prefill <= 0 and num_prefill > min_per_side:
        return "prefill"
    if decision.delta_prefill > 0 and decision.delta_decode <= 0 and num_decode > min_per_side:
        return "decode"
    return ""
