"""The conductor that leads (one at a time, by etcd election) runs the dynamic P/D ratio controller.

1. `start()` stands for election (a key on this conductor's lease, membership in etcd only) and starts the loop.
   Every conductor runs the loop; only the leader acts, so a new leader takes over within the lease TTL of the
   old one's death (its key expires, the next oldest candidate leads).
2. Each period (`pd_controller.interval_s`) the leader measures each pool from the workers' LOAD replies:
   prefill load = queue time (queued and running work times the measured prefill time) / TTFT SLO; decode
   load = the larger of the measured step time / TBT SLO and the batch's fill. It feeds `SwitchPlanner`
   (sched/pd_switch.py: a switch only when what it brings within the SLOs over the horizon outweighs what it
   costs, with persistence and dwell scaled by that cost), and when that names an instance, sends it SWITCH and
   waits for the reply (the instance drains, switches, registers again); how long that took is the instance's
   measured switch cost.
3. `stop()` cancels the loop (a supervised task: an unexpected exception is logged and the loop restarts); the
   candidacy goes with the lease when the membership stops.

Owns the planner, the loop task and the record of switches this conductor ordered. Borrows the view, the peer
clients and the membership.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from mooncaked.cluster.etcd_membership import EtcdMembership
from mooncaked.config import Config
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.view.cluster import ClusterView, WorkerState
from mooncaked.roles.worker.switch_messages import SWITCH, SwitchRequest
from mooncaked.rpc import RpcError
from mooncaked.runtime.supervised import start_supervised, stop_task
from mooncaked.sched.pd_ratio import PdRatioConfig
from mooncaked.sched.pd_switch import SwitchCandidate, SwitchPlan, SwitchPlanner, SwitchPolicy

logger = logging.getLogger(__name__)

NUM_SWITCHES_KEPT = 32


def prefill_load(worker: WorkerState, ttft_slo_s: float) -> float:
    load = worker.load
    if load is None:
        return 0.0
    return (load.num_waiting + load.num_running) * load.step_time_s / ttft_slo_s


def decode_load(worker: WorkerState, tbt_slo_s: float) -> float:
    """The batch's fill (or the step time over the TBT SLO, the larger). Decode work is the running sequences and
    the reservations whose KV is ready; a reservation whose prompt is still prefilling holds a batch slot without
    being decode work. RESERVE calls waiting for room (admission none/baseline queue there) count in the share of
    the slots decode work holds: a backlog behind decoding sequences is the decode pool's, one behind prompts in
    prefill is not (it would read as decode demand whenever prefill is slow)."""
    load = worker.load
    if load is None:
        return 0.0
    num_decoding = load.num_running + max(load.num_waiting - load.num_prefilling, 0)
    share = num_decoding / max(num_decoding + load.num_prefilling, 1)
    fill = (num_decoding + load.num_reserving * share) / max(worker.max_num_running, 1)
    step = load.step_time_s / tbt_slo_s if load.num_running else 0.0
    return max(step, fill)


def drain_s(worker: WorkerState, now: float) -> float:
    """What the instance predicts its held work takes (decode: its running sequences; prefill: its queue), as of
    `now` (monotonic): a switch out of its role waits for that first."""
    load = worker.load
    if load is None:
        return 0.0
    held_s = load.drain_s if worker.instance.role == "decode" else load.pending_work_s
    return max(held_s - (now - worker.polled_at), 0.0)


def switch_policy(config: Config) -> SwitchPolicy:
    section = config.pd_controller
    ratio = PdRatioConfig(trim_fraction=section.trim_fraction, tolerance=section.tolerance,
                          scale_out_load=section.scale_out_load, scale_in_load=section.scale_in_load,
                          max_step=1, min_per_side=section.min_per_side)
    return SwitchPolicy(ratio, section.window, section.num_confirm, section.dwell_s, section.interval_s,
                        section.horizon_s, section.gain_margin, section.switch_cost_s, section.dwell_per_cost,
                        section.reversal_factor)


class PdController:
    """See the module docstring."""

    def __init__(self, config: Config, view: ClusterView, peers: PeerClients, membership: EtcdMembership) -> None:
        section = config.pd_controller
        self.config = config
        self.section = section
        self.view = view
        self.peers = peers
        self.membership = membership
        self.planner = SwitchPlanner(switch_policy(config))
        self.switches: deque[dict[str, Any]] = deque(maxlen=NUM_SWITCHES_KEPT)
        self.last_switch_at: dict[str, float] = {}
        self.is_leading = False
        self.num_switches = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.membership.campaign()
        self._task = start_supervised("pd-controller", self._run)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    def describe(self) -> dict[str, Any]:
        decision = self.planner.last_decision
        return {"leader": self.membership.leader(), "is_leader": self.is_leading, "enabled": self.section.enabled,
                "last_decision": None if decision is None else {"reason": decision.reason,
                                                                "imbalance_factor": decision.imbalance_factor},
                "prefill_loads": list(self.planner.prefill_loads), "decode_loads": list(self.planner.decode_loads),
                "last_gain": self.planner.last_gain, "switch_cost_s": self.planner.measured_costs(),
                "num_switches": self.num_switches,
                "switches": list(self.switches)}

    async def _run(self) -> None:
        while True:
            changed = self.membership.leader_changed()
            self._follow_leadership()
            if self.is_leading and self.section.enabled:
                try:
                    await self._step(time.monotonic())
                except Exception:  # a bad sample must not end the controller
                    logger.exception("P/D controller step failed")
            try:
                await asyncio.wait_for(changed.wait(), self.section.interval_s)
            except TimeoutError:
                pass

    def _follow_leadership(self) -> None:
        is_leading = self.membership.is_leader()
        if is_leading != self.is_leading:
            logger.info("P/D controller: %s", "this conductor leads" if is_leading
                        else f"following (leader: {self.membership.leader() or 'unknown'})")
            self.planner.reset()  # samples a former leader's period left are stale
        self.is_leading = is_leading

    async def _step(self, now: float) -> None:
        scheduler = self.config.scheduler
        prefill = [w for w in self.view.prefill.values() if w.is_placeable]
        decode = [w for w in self.view.decode.values() if w.is_placeable]
        ttft_slo_s, tbt_slo_s = scheduler.ttft_slo_ms / 1000, scheduler.tbt_slo_ms / 1000
        self.planner.observe(
            sum(prefill_load(w, ttft_slo_s) for w in prefill) / len(prefill) if prefill else None,
            sum(decode_load(w, tbt_slo_s) for w in decode) / len(decode) if decode else None)
        records = self.membership.members()
        candidates = [SwitchCandidate(w.instance.name, w.instance.role,
                                      records[w.instance.name].is_switchable if w.instance.name in records else False,
                                      w.is_placeable, prefill_load(w, ttft_slo_s) if w.instance.role == "prefill"
                                      else decode_load(w, tbt_slo_s), self.last_switch_at.get(w.instance.name),
                                      drain_s(w, now))
                      for w in self.view.workers if w.state != "draining"]
        plan = self.planner.plan(candidates, now)
        if plan is not None:
            await self._apply(plan)

    async def _apply(self, plan: SwitchPlan) -> None:
        decision = plan.decision
        logger.info("P/D controller: switching %s %s -> %s (%s, imbalance %.2f, gain %.2f instances, expected "
                    "cost %.1f s)", plan.name, plan.from_role, plan.to_role, decision.reason,
                    decision.imbalance_factor, plan.gain, plan.cost_s)
        timeout_s = self.section.switch_timeout_s
        record: dict[str, Any] = {"instance": plan.name, "from_role": plan.from_role, "to_role": plan.to_role,
                                  "reason": decision.reason, "at": time.time(), "is_switched": False,
                                  "gain": plan.gain, "expected_cost_s": plan.cost_s}
        started = time.monotonic()
        try:
            reply = await self.peers.for_instance(self.view.instance_config(plan.name)).call(
                SWITCH, SwitchRequest(plan.to_role, decision.reason, timeout_s), timeout_s=timeout_s + 5.0)
        except RpcError as exc:
            logger.warning("P/D controller: switching %s failed: %s", plan.name, exc)
            record["error"] = str(exc)
        else:
            record.update(is_switched=reply.is_switched, drain_s=reply.drain_s, num_cancelled=reply.num_cancelled)
            self.num_switches += int(reply.is_switched)
            if not reply.is_switched:
                logger.info("P/D controller: %s did not switch: %s", plan.name, reply.reason)
                record["error"] = reply.reason
        now = time.monotonic()
        record["cost_s"] = now - started
        self.last_switch_at[plan.name] = now
        self.planner.switched(plan.name, now, now - started, plan.from_role)
        self.switches.append(record)
