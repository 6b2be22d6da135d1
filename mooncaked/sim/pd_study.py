"""The P/D switch planner under phase changes and noisy load signals (`mooncaked sim pd-study`).

1. A fleet of `num_instances` switchable instances serves alternating phases of `phase_s` seconds: prompt-heavy
   (prefill demand `heavy_demand`, decode demand `light_demand`, in instances' worth of work at the SLO), then
   output-heavy (the reverse), `num_phases` phases in all.
2. A fluid model, one step per control period: each pool serves up to one period of work per serving instance;
   what it cannot serve waits. Work served while its pool's backlog is within that pool's SLO (`prefill_slo_s`,
   `decode_slo_s` of queueing) is goodput. A pool's load is its demand and backlog over its capacity (1.0: it
   just keeps up), as the conductor's leader measures it from LOAD replies.
3. Variants, each on the same demand: `static` (the starting split, never switched), `oracle` (switches once at
   each phase boundary to the split with the most goodput for the coming phase, paying the switch time), and
   `planner`: sched/pd_switch.py's SwitchPlanner, fed every pool load times a random factor drawn uniformly in
   [`noise_low`, `noise_high`] (what a busy host does to measured step and queue times), switching one instance
   at a time; a switching instance serves nothing for its drain (its share of its pool's backlog, at most
   `max_drain_s`) plus `reload_s`, which is the cost the planner measures.
4. Reported per variant: goodput (instance-seconds of work served within the SLOs), switches, switches per
   phase change, and the planner's goodput against the static split's and the oracle's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from mooncaked.sched.pd_ratio import PdRatioConfig
from mooncaked.sched.pd_switch import SwitchCandidate, SwitchPlanner, SwitchPolicy


@dataclass(frozen=True)
class PdStudyConfig:
    num_instances: int = 5
    num_prefill_start: int = 3
    phase_s: float = 120.0
    num_phases: int = 4
    heavy_demand: float = 2.6
    light_demand: float = 1.6
    interval_s: float = 1.0
    prefill_slo_s: float = 5.0
    decode_slo_s: float = 1.0
    noise_low: float = 0.7
    noise_high: float = 1.5
    reload_s: float = 2.0
    max_drain_s: float = 10.0
    seed: int = 0
    policy: SwitchPolicy = field(default_factory=lambda: SwitchPolicy(PdRatioConfig(
        tolerance=0.5, scale_out_load=0.9, scale_in_load=0.05, min_per_side=1)))

    def __post_init__(self) -> None:
        if not 2 <= self.num_instances or not 1 <= self.num_prefill_start < self.num_instances:
            raise ValueError("need at least 2 instances and a starting split with both pools")
        if self.phase_s <= 0 or self.num_phases < 1 or self.interval_s <= 0:
            raise ValueError("phase_s and interval_s must be > 0, num_phases >= 1")
        if not 0 < self.noise_low <= self.noise_high:
            raise ValueError("noise factors must satisfy 0 < noise_low <= noise_high")


@dataclass
class Pool:
    """One pool's backlog (instance-seconds of work) and its goodput so far; owned by its Fleet."""

    slo_s: float
    backlog: float = 0.0
    goodput: float = 0.0

    def step(self, demand: float, num_serving: int, dt: float) -> float:
        """Serve one period; returns the load it saw (demand and backlog over capacity)."""
        capacity = num_serving * dt
        work = self.backlog + demand * dt
        served = min(work, capacity)
        if num_serving and self.backlog / num_serving <= self.slo_s:
            self.goodput += served
        self.backlog = work - served
        return work / capacity if capacity else float("inf")


@dataclass
class Fleet:
    """The instances' roles and switches in flight, and both pools; owned by one variant's run."""

    roles: dict[str, str]
    pools: dict[str, Pool]
    busy_until: dict[str, float] = field(default_factory=dict)  # switching instance -> when it serves again
    target: dict[str, str] = field(default_factory=dict)  # switching instance -> its new role
    num_switches: int = 0

    def serving(self, role: str, now: float) -> int:
        return sum(1 for name, r in self.roles.items() if r == role and name not in self.busy_until)

    def start_switch(self, name: str, to_role: str, now: float, reload_s: float, max_drain_s: float) -> float:
        """The instance drains its share of its pool's backlog, reloads, then serves `to_role`; returns the cost."""
        role = self.roles[name]
        cost_s = self.drain_s(name, now, max_drain_s) + reload_s
        self.busy_until[name] = now + cost_s
        self.target[name] = to_role
        self.num_switches += 1
        return cost_s

    def drain_s(self, name: str, now: float, max_drain_s: float) -> float:
        """The instance's share of its pool's backlog: what it would drain before a switch."""
        role = self.roles[name]
        return min(self.pools[role].backlog / max(self.serving(role, now), 1), max_drain_s)

    def finish_switches(self, now: float) -> list[str]:
        done = [name for name, until in self.busy_until.items() if until <= now]
        for name in done:
            del self.busy_until[name]
            self.roles[name] = self.target.pop(name)
        return done


def demand_at(config: PdStudyConfig, now: float) -> dict[str, float]:
    is_prompt_heavy = int(now // config.phase_s) % 2 == 0
    heavy, light = config.heavy_demand, config.light_demand
    return {"prefill": heavy if is_prompt_heavy else light, "decode": light if is_prompt_heavy else heavy}


def best_split(config: PdStudyConfig, demand: dict[str, float]) -> int:
    """The number of prefill instances that serves the most of `demand` within the SLOs (steady state)."""
    def served(num_prefill: int) -> float:
        num_decode = config.num_instances - num_prefill
        return min(demand["prefill"], num_prefill) + min(demand["decode"], num_decode)
    return max(range(1, config.num_instances), key=lambda n: (served(n), -abs(n - config.num_prefill_start)))


def run_variant(config: PdStudyConfig, variant: str) -> dict[str, Any]:
    names = [f"w{i}" for i in range(config.num_instances)]
    roles = {name: "prefill" if i < config.num_prefill_start else "decode" for i, name in enumerate(names)}
    fleet = Fleet(roles, {"prefill": Pool(config.prefill_slo_s), "decode": Pool(config.decode_slo_s)})
    planner = SwitchPlanner(config.policy)
    rng = random.Random(config.seed)
    last_switch_at: dict[str, float] = {}
    cost_of: dict[str, float] = {}
    dt = config.interval_s
    num_steps = int(config.num_phases * config.phase_s / dt)
    for step in range(num_steps):
        now = step * dt
        for name in fleet.finish_switches(now):
            last_switch_at[name] = now
            if variant == "planner":
                planner.switched(name, now, cost_of[name], "decode" if fleet.roles[name] == "prefill"
                                 else "prefill")
        demand = demand_at(config, now)
        if variant == "oracle" and step and int(now // config.phase_s) != int((now - dt) // config.phase_s):
            _oracle_switch(config, fleet, demand, now)
        loads = {role: fleet.pools[role].step(demand[role], fleet.serving(role, now), dt)
                 for role in ("prefill", "decode")}
        if variant != "planner" or fleet.busy_until:
            continue
        planner.observe(*(min(loads[role], 100.0) * rng.uniform(config.noise_low, config.noise_high)
                          for role in ("prefill", "decode")))
        candidates = [SwitchCandidate(name, role, True, name not in fleet.busy_until, loads[role],
                                      last_switch_at.get(name), fleet.drain_s(name, now, config.max_drain_s))
                      for name, role in fleet.roles.items()]
        plan = planner.plan(candidates, now)
        if plan is not None:
            cost_of[plan.name] = fleet.start_switch(plan.name, plan.to_role, now, config.reload_s,
                                                    config.max_drain_s)
    goodput = sum(pool.goodput for pool in fleet.pools.values())
    return {"goodput": goodput, "num_switches": fleet.num_switches,
            "switches_per_phase_change": fleet.num_switches / max(config.num_phases - 1, 1)}


def _oracle_switch(config: PdStudyConfig, fleet: Fleet, demand: dict[str, float], now: float) -> None:
    """At a phase boundary: move to the coming phase's best split at once, every moved instance paying its time."""
    num_prefill = sum(1 for role in fleet.roles.values() if role == "prefill")
    wanted = best_split(config, demand)
    if wanted < num_prefill:
        from_role, num_moved = "prefill", num_prefill - wanted
    else:
        from_role, num_moved = "decode", wanted - num_prefill
    to_role = "decode" if from_role == "prefill" else "prefill"
    movers = [name for name, role in fleet.roles.items() if role == from_role][:num_moved]
    for name in movers:
        fleet.start_switch(name, to_role, now, config.reload_s, config.max_drain_s)
    if movers:
        fleet.num_switches -= len(movers) - 1  # one switch of the split, however many instances it moves


def run_pd_study(config: PdStudyConfig) -> dict[str, Any]:
    results = {variant: run_variant(config, variant) for variant in ("static", "oracle", "planner")}
    planner, static, oracle = results["planner"], results["static"], results["oracle"]
    return {"variants": results,
            "goodput_vs_static": planner["goodput"] / static["goodput"] if static["goodput"] else float("nan"),
            "goodput_vs_oracle": planner["goodput"] / oracle["goodput"] if oracle["goodput"] else float("nan"),
            "switches_per_phase_change": planner["switches_per_phase_change"]}


def format_result(result: dict[str, Any]) -> str:
    lines = ["| variant | goodput (instance-s) | switches | per phase change |", "| --- | --- | --- | --- |"]
    for name, row in result["variants"].items():
        lines.append(f"| {name} | {row['goodput']:.1f} | {row['num_switches']} | "
                     f"{row['switches_per_phase_change']:.2f} |")
    lines.append(f"planner goodput / static: {result['goodput_vs_static']:.3f}; / oracle: "
                 f"{result['goodput_vs_oracle']:.3f}")
    return "\n".join(lines)
