"""What moving one instance between prefill and decode gains, and what it costs (the P/D switch planner's
arithmetic, sched/pd_switch.py).

1. A pool at load L (1.0: its requests meet their SLO exactly; the planner's smoothed sample) with n instances
   carries L x n instances' worth of demand. What a pool cannot serve within its SLO is the demand beyond
   `target` x n (the scale-out load): its *excess*, in instances.
2. `switch_gain`: the excess of both pools now, less their excess with one instance moved from `from_role` to
   the other pool, the demand staying where it is. Positive only when the hot side is past its target and the
   cold side can give an instance without going past its own: a switch that would only move the bottleneck
   gains nothing, and neither does one between two pools that both meet their SLOs.
3. Over a horizon of `horizon_s` seconds a switch gains `gain x horizon_s` instance-seconds and costs the
   switching instance's own switch time (its drain and re-registration, measured per instance): the planner
   switches only when the first exceeds the second by a margin.

Pure: standard library only, no clock.
"""

from __future__ import annotations


def excess(load: float, num_instances: int, num_serving: int, target: float) -> float:
    """Instances' worth of a pool's demand (`load` over `num_instances`) beyond what `num_serving` instances serve
    at `target` load."""
    return max(load * num_instances - target * num_serving, 0.0)


def switch_gain(prefill_load: float, decode_load: float, num_prefill: int, num_decode: int, from_role: str,
                target: float) -> float:
    """Instances' worth of demand brought within its SLO by moving one instance out of `from_role`'s pool."""
    before = excess(prefill_load, num_prefill, num_prefill, target) + excess(decode_load, num_decode, num_decode,
                                                                           target)
    if from_role == "prefill":
        after = excess(prefill_load, num_prefill, num_prefill - 1, target) + excess(decode_load, num_decode,
                                                                                  num_decode + 1, target)
    else:
        after = excess(prefill_load, num_prefill, num_prefill + 1, target) + excess(decode_load, num_decode,
                                                                                  num_decode - 1, target)
    gain = before - after
    return gain if gain > 1e-9 else 0.0  # float noise of equal excesses is no gain
