"""Discrete-event simulation of a Mooncake cluster on virtual time, driving the real `sched/` and `kv/` code.

A request's life in the simulator:
1. ARRIVAL: the engine builds the instance views and calls `mooncaked.sched.inline.place` (Algorithm 1, or an
   inline prefill on a decode instance, as the conductor places); a Rejection is recorded. The decode instance's
   RESERVE rule (`sched.decode_admission.reserve_refusal`) then sets the request's KV pages (prompt and output;
   none when its prefill's first token ends it, `sched.decode_memory.is_decoding`) aside until it ends, or refuses
   it (recorded as `decode_<reason>`; under `none` and `baseline` the request waits in the decode instance's queue
   instead). An inline Placement queues the prefill for the decode instance's next step, which runs it before its
   decode. A Placement locks the reused prefix in its store(s), starts the remote fetch if any (it holds the source
   and destination NICs for bytes / bandwidth), queues the prefill job and announces a request that decodes to its
   decode instance as incoming.
2. FETCH_DONE: the fetched blocks are in the job's pages; they are committed to the prefill host's store where
   they find room (hot-spot replication; prefix_fetch.py).
3. Prefill (prefill_side.py): each forward takes the jobs `sched.prefill_batch.take_batch` picks (the prefill
   role's rule: by class, priority and arrival, within `cluster.max_batch_tokens`; a prompt longer than
   `cluster.prefill_chunk` alone); it starts when the instance is free and every job's fetch is done, and takes
   the sum of the cost model's times for each job's (prompt, reused prefix). With `cluster.device_prefix_blocks`
   each prefill instance has a device prefix cache (device_tier.py, the engine's policy): a job reads its
   longest cached prefix there first, and its full prompt blocks stay cached when it ends; Algorithm 1 counts
   that tier in the instance's local prefix (the device index). Decode instances have one too: an inline prefill
   reads its prefix there, a prefilled request's KV fills its pages, and a finished request's blocks stay.
   A prefill group (`cluster.num_prefill_groups`) is one instance whose time follows its pipeline
   (sched/pipeline.py: fill, steady state, drain) over stages that each take an equal share of the cost model's
   layers, as the conductor predicts a group whose stages have not reported fits. PREFILL_DONE commits every
   block of the prompt to the prefill host's store (and, when configured, to the decode host's), which is the
   first token.
4. Decode (decode_side.py): under admission `baseline` the decode instance may refuse the request now (wasted
   prefill, `sched.decode_admission.refusal_after_prefill`). Otherwise DECODE_READY (after the part of the KV stream
   not hidden behind prefill and the load into HBM) queues it at its decode instance, which runs continuous-batching
   steps; each step's duration is the cost model's and gives every running request one token gap (decode_batch.py).
   TBT = mean of the longest 10% of the gaps.
5. SAMPLE events record the prefill and decode pool loads and the pool's duplicate blocks (copies beyond the
   first) every `run.sample_interval_s`; each store counts its evictions and its sole-copy evictions.
6. The pool-wide policies (replica tracker, store recency: pool.py) hear of every placement, and after every
   event the tracker's spare marks go to the stores.
Predictions may be imperfect: `run.prefill_noise` perturbs true prefill times, and with
`run.output_length_predictor` other than `uniform` each placed request gets a predicted output length
(output_forecast.py) that prediction-based early rejection uses instead of the uniform t_d.
Events at equal times run in scheduling order (a sequence number breaks ties), so runs are deterministic.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import time
from collections.abc import Callable
from typing import Any

from mooncaked.sched.algorithm import SchedulerPolicy
from mooncaked.sched.decode_admission import (WAITING_POLICIES, capacity_refusal, refusal_after_prefill,
                                              rejection_reason)
from mooncaked.sched.decode_memory import decode_num_pages, is_decoding
from mooncaked.sched.inline import place
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import REASON_DECODE_REFUSED, DecodeInstanceView, Placement, RequestInfo
from mooncaked.sim.cluster import DecodeInstance, DecodeSeq, PrefillJob, build_instances
from mooncaked.sim.config import SimConfig
from mooncaked.sim.costs import CostModel, build_cost_model
from mooncaked.sim.decode_batch import kv_ready_at
from mooncaked.sim.decode_reserve import DecodeReserve
from mooncaked.sim.decode_side import DecodeSide
from mooncaked.sim.output_forecast import OutputForecast
from mooncaked.sim.pool import PoolPolicies
from mooncaked.sim.prefill_side import PrefillSide
from mooncaked.sim.results import LoadSample, RequestRecord, SimResult
from mooncaked.sim.trace import TraceRequest

ARRIVAL, FETCH_DONE, PREFILL_DONE, DECODE_READY, DECODE_STEP, SAMPLE = range(6)

ProgressCallback = Callable[[int, int], None]


class Simulator:
    """Owns the event queue, the cluster state, the shadow index and the per-request records of one run."""

    def __init__(self, config: SimConfig, requests: list[TraceRequest]) -> None:
        self.config = config
        self.costs: CostModel = build_cost_model(config)
        self.reserve = DecodeReserve(config, self.costs)
        self.policy = SchedulerPolicy(config.scheduler, self.costs.predictors)
        self.requests = requests
        self.index = ShadowIndex()
        self.device_index = ShadowIndex()  # the prefill instances' device prefix caches (cluster.device_prefix_blocks)
        self.rng = random.Random(config.run.seed)
        self.records = [
            RequestRecord(r.index, r.arrival_s, r.input_length, self._output_length(r), len(r.hash_ids))
            for r in requests
        ]
        self.samples: list[LoadSample] = []
        run = config.run
        self.forecast = OutputForecast(run.output_length_predictor, noise=run.output_length_noise,
                                       max_tokens=run.max_tokens, quantile=run.output_length_quantile,
                                       seed=run.seed + 1)
        self.predicted_tokens: dict[int, int] = {}  # request index -> predicted output tokens (placed requests)
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.pool = PoolPolicies(config.scheduler, self.index, self.costs.predictors)
        self._build_cluster()

    def _output_length(self, request: TraceRequest) -> int:
        length = round(request.output_length * self.config.run.output_length_scale)
        cap = self.config.run.output_length_cap
        return min(length, cap) if cap else length

    def _build_cluster(self) -> None:
        self.prefill, self.decode = build_instances(self.config, self.costs, self.index, self.pool.is_replica_aware,
                                                    self.device_index)
        self.prefill_by_id = {p.instance_id: p for p in self.prefill}
        self.decode_by_id = {d.instance_id: d for d in self.decode}
        self.store_by_id = {p.store.store_id: p.store for p in self.prefill}
        self.store_by_id.update({d.store.store_id: d.store for d in self.decode})
        self._busy_at_last_sample = [0.0] * len(self.prefill)
        self.prefill_side = PrefillSide(self.config, self.costs, self.policy, self.pool, self.records,
                                        self.prefill_by_id, self.store_by_id, self.rng, self._push,
                                        (FETCH_DONE, PREFILL_DONE), self._hand_to_decode)
        self.decode_side = DecodeSide(self.config, self.costs, self.pool, self.records, self.requests,
                                      self.decode_by_id, self.prefill_side.noisy, self._push, DECODE_STEP,
                                      self._finish)

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, payload))

    def run(self, progress: ProgressCallback | None = None) -> SimResult:
        started = time.perf_counter()
        for request in self.requests:
            self._push(request.arrival_s, ARRIVAL, request)
        if self.requests:
            self._push(self.config.run.sample_interval_s, SAMPLE, None)
        handlers = (self._on_arrival, self.prefill_side.on_fetch_done, self.prefill_side.on_prefill_done,
                    self.decode_side.on_decode_ready, self.decode_side.on_decode_step, self._on_sample)
        num_done = 0
        now = 0.0
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            handlers[kind](now, payload)
            self.pool.apply_marks(self.store_by_id, now)
            if kind == ARRIVAL:
                num_done += 1
                if progress is not None and num_done % 200 == 0:
                    progress(num_done, len(self.requests))
        for decode in self.decode:  # the calls still waiting for room at the end gave up
            for request, _, _, first_refusal in decode.reserve_queue:
                self.records[request.index].rejection_reason = rejection_reason(first_refusal)
            decode.reserve_queue.clear()
        if progress is not None:
            progress(len(self.requests), len(self.requests))
        stores = self.store_by_id.values()
        return SimResult(self.records, self.samples, time.perf_counter() - started, now,
                         num_evicted_blocks=sum(s.num_evicted for s in stores),
                         num_sole_copy_evictions=sum(s.num_sole_copy_evictions for s in stores))

    def _on_arrival(self, now: float, request: TraceRequest) -> None:
        record = self.records[request.index]
        predicted = self.forecast.predict(request.input_length, record.output_length) if self.forecast.is_enabled else 0
        # the trace's output length stands for max_tokens: the pages a decode instance holds for the request
        info = RequestInfo(str(request.index), request.input_length, request.hash_ids, now, record.output_length,
                           predicted)
        is_predicted = self.config.scheduler.admission == "early_rejection_predicted"
        decision = place(
            info,
            [p.view(self.pool.coldest_use(p.store.store_id)) for p in self.prefill],
            [self._decode_view(d, is_predicted, now) for d in self.decode],
            self.index,
            self.policy,
            now,
            self.device_index,
        )
        record.predicted_ttft_s = decision.predicted_ttft_s
        if not isinstance(decision, Placement):
            record.rejection_reason = decision.reason
            return
        decode = self.decode_by_id[decision.decode_instance]
        num_pages = decode_num_pages(record.input_length, record.output_length, decode.block_size,
                                     is_inline_prefill=not decision.prefill_instance)
        refusal = capacity_refusal(num_pages, decode.num_pages)
        if not refusal:
            refusal = self._reserve_refusal(decode, record, decision, predicted, now)
            if self.config.scheduler.admission in WAITING_POLICIES and (refusal or decode.reserve_queue):
                # RESERVE waits for room in arrival order, and the prefill with it
                reason = refusal or "queued: behind the requests waiting for room"
                decode.reserve_queue.append((request, decision, predicted, reason))
                return
        if refusal:
            record.rejection_reason = rejection_reason(refusal)
            return
        self._start(now, decode, request, decision, predicted)

    def _start(self, now: float, decode: DecodeInstance, request: TraceRequest, placement: Placement,
               predicted: int) -> None:
        """RESERVE took the request: its pages are the decode instance's to give, and its prefill (or inline
        prefill) begins."""
        record, is_inline = self.records[request.index], not placement.prefill_instance
        decode.reserved_pages[request.index] = decode_num_pages(record.input_length, record.output_length,
                                                                decode.block_size, is_inline_prefill=is_inline)
        decode.decode_s[request.index] = self.reserve.decode_s(decode, predicted)
        if predicted:
            self.predicted_tokens[request.index] = predicted
        if not is_inline:
            self._place(now, request, placement, record)
        else:
            self.decode_side.place_inline(now, request, placement, record)

    def _retry_reserves(self, now: float, decode: DecodeInstance) -> None:
        """Under `none` and `baseline`: the RESERVE calls waiting for room, in arrival order, as pages free. A call
        gives up after the TTFT SLO (the daemon's RESERVE waits until its call's deadline): refused as the decode
        instance refused it at first."""
        while decode.reserve_queue:
            request, placement, predicted, first_refusal = decode.reserve_queue[0]
            record = self.records[request.index]
            if now - record.arrival_s > self.config.scheduler.ttft_slo_s:
                decode.reserve_queue.popleft()
                record.rejection_reason = rejection_reason(first_refusal)
                continue
            if self._reserve_refusal(decode, record, placement, predicted, now):
                return
            decode.reserve_queue.popleft()
            self._start(now, decode, request, placement, predicted)

    def _reserve_refusal(self, decode: DecodeInstance, record: RequestRecord, placement: Placement, predicted: int,
                         now: float) -> str:
        return self.reserve.refusal(decode, record.input_length, record.output_length, placement, predicted,
                                    self.predicted_tokens, now)

    def _decode_view(self, decode: DecodeInstance, is_predicted: bool, now: float) -> DecodeInstanceView:
        if not self.forecast.is_enabled:
            view = decode.view(is_predicted)
        else:
            step_s = self.costs.predictors.decode.predict(len(decode.running) + 1, decode.num_context_tokens)
            view = decode.view(is_predicted, self.predicted_tokens, step_s)
        if not is_predicted:
            return view
        page_holds = self.reserve.page_holds(decode, now, self.predicted_tokens)
        return dataclasses.replace(view, num_pages=decode.num_pages, page_holds=page_holds)

    def _place(self, now: float, request: TraceRequest, placement: Placement, record: RequestRecord) -> None:
        """A placement with a prefill instance: its job there, and the request incoming on its decode instance."""
        decode = self.decode_by_id[placement.decode_instance]
        if is_decoding(record.output_length, is_inline_prefill=False):  # else its prefill's first token ends it
            decode.incoming[request.index] = (now + placement.predicted_decode_start_s, request.input_length)
        self.prefill_side.place(now, request, placement, record)

    def _hand_to_decode(self, now: float, job: PrefillJob, record: RequestRecord) -> None:
        decode = self.decode_by_id[job.placement.decode_instance]
        decode.incoming.pop(job.request_index, None)
        if record.output_length <= 1:
            self._finish(record, now, 0.0)
            return
        refusal = refusal_after_prefill(self.config.scheduler.admission, len(decode.running),
                                        decode.num_context_tokens, job.num_prompt_tokens, self.reserve.step_limit())
        if refusal:  # admission `baseline`: the decode instance checks its load only now; the prefill is wasted
            record.rejection_reason = REASON_DECODE_REFUSED
            record.wasted_prefill = True
            decode.reserved_pages.pop(record.index, None)
            decode.decode_s.pop(record.index, None)
            self.predicted_tokens.pop(record.index, None)
            self._retry_reserves(now, decode)
            return
        if self.config.cluster.decode_hosts_in_pool:
            decode.store.put(job.keys, now)
        if decode.device is not None:  # the transfer fills its pages (a prefix it caches is read in place)
            decode.device.start_prompt(job.request_index, job.keys, job.num_prompt_tokens,
                                       self.config.scheduler.block_size)
        ready = kv_ready_at(now, job.num_prompt_tokens, job.compute_s, self.costs)
        seq = DecodeSeq(job.request_index, job.num_prompt_tokens + 1, record.output_length - 1, now, ready_at=ready,
                        is_first_token_held=job.placement.decode_defer_s > 0)
        decode.incoming[job.request_index] = (ready, seq.context_tokens)
        self._push(ready, DECODE_READY, (decode, seq))

    def _finish(self, record: RequestRecord, now: float, tbt_s: float) -> None:
        config = self.config.scheduler
        self.predicted_tokens.pop(record.index, None)
        decode = self.decode_by_id[record.decode_instance]
        decode.reserved_pages.pop(record.index, None)
        decode.decode_s.pop(record.index, None)
        if decode.device is not None and decode.device.is_running(record.index):
            decode.device.finish(record.index, self.requests[record.index].hash_ids)
        self._retry_reserves(now, decode)
        self.forecast.observe(record.input_length, record.output_length)
        record.tbt_s = tbt_s
        record.finished_s = now
        record.slo_met = record.ttft_s <= config.ttft_slo_s and tbt_s <= config.tbt_slo_s

    def _on_sample(self, now: float, _: None) -> None:
        interval = self.config.run.sample_interval_s
        busy = [p.busy_time(now) for p in self.prefill]
        nodes = [p.num_nodes for p in self.prefill]  # a group keeps every one of its nodes busy
        busy_s = sum(n * (b - last) for n, b, last in zip(nodes, busy, self._busy_at_last_sample))
        prefill_load = busy_s / (interval * sum(nodes))
        self._busy_at_last_sample = busy
        slo = self.config.scheduler.tbt_slo_s
        decode_load = sum(d.step_time_s for d in self.decode) / (slo * len(self.decode)) if self.decode else 0.0
        num_running = sum(len(d.running) for d in self.decode)
        num_duplicates = self.index.num_copies - self.index.num_keys
        self.samples.append(LoadSample(now, prefill_load, decode_load, num_running, num_duplicates))
        if len(self._events) > 0:
            self._push(now + interval, SAMPLE, None)
