"""The prefill side of a simulation run: jobs queued on prefill instances, their remote fetches and forwards.

1. `place` records the placement, locks the reused local prefix in the instance's store, starts the remote fetch
   if any (FETCH_DONE at its end; it holds the source and destination NICs for bytes / bandwidth) and queues the job.
2. `try_start`: when the instance is free, its next forward takes the jobs `sched.prefill_batch.take_batch` picks;
   it starts when every job's fetch is done and lasts the sum of the cost model's times (a prefill group's follow
   its pipeline), each perturbed by `run.prefill_noise` (`noisy`); PREFILL_DONE at its end.
   With a device tier (device_tier.py) a job first reads its longest cached prefix from it.
3. `on_prefill_done` commits each job's prompt blocks to the host's store (the first token) and leaves them in
   the instance's device tier if it has one, frees the instance,
   starts its next forward and hands each job to the decode side (`on_prefilled`).
Owns nothing: the engine owns the instances, records, stores and the event queue it pushes to.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from mooncaked.sched.algorithm import SchedulerPolicy, prefill_model
from mooncaked.sched.prefill_batch import take_batch
from mooncaked.sched.types import Placement
from mooncaked.sim.cluster import HostStore, PrefillInstance, PrefillJob
from mooncaked.sim.config import SimConfig
from mooncaked.sim.costs import CostModel
from mooncaked.sim.pool import PoolPolicies
from mooncaked.sim.prefix_fetch import finish_fetch, reusable_blocks_at_start, start_fetch
from mooncaked.sim.results import RequestRecord
from mooncaked.sim.trace import TraceRequest

Push = Callable[[float, int, Any], None]
OnPrefilled = Callable[[float, PrefillJob, RequestRecord], None]


class PrefillSide:
    """See the module docstring."""

    def __init__(self, config: SimConfig, costs: CostModel, policy: SchedulerPolicy, pool: PoolPolicies,
                 records: list[RequestRecord], instances: Mapping[str, PrefillInstance],
                 stores: Mapping[str, HostStore], rng: random.Random, push: Push, kinds: tuple[int, int],
                 on_prefilled: OnPrefilled) -> None:
        self.config = config
        self.costs = costs
        self.policy = policy
        self.pool = pool
        self.records = records
        self.instances = instances
        self.stores = stores
        self.rng = rng
        self.push = push
        self.fetch_done_kind, self.prefill_done_kind = kinds
        self.on_prefilled = on_prefilled

    def place(self, now: float, request: TraceRequest, placement: Placement, record: RequestRecord) -> None:
        instance = self.instances[placement.prefill_instance]
        keys = request.hash_ids
        self.pool.note_use(instance.store.store_id, keys, placement.num_prefix_blocks, now)
        record.prefill_instance = placement.prefill_instance
        record.is_pipelined = instance.pipeline is not None
        record.decode_instance = placement.decode_instance
        record.prefix_blocks = placement.num_prefix_blocks
        record.local_prefix_blocks = placement.num_local_prefix_blocks
        num_prefix_tokens = min(placement.num_prefix_blocks * self.config.scheduler.block_size,
                                request.input_length - 1)
        job = PrefillJob(request.index, placement, keys, request.input_length, now, False,
                         num_new_tokens=request.input_length - num_prefix_tokens, enqueued_at=now)
        job.locked_keys = list(keys[: placement.num_local_prefix_blocks])
        instance.store.cache.lock(job.locked_keys)
        if placement.fetch_from_store is not None and placement.num_fetch_blocks > 0:
            record.fetched_blocks = placement.num_fetch_blocks
            record.fetch_source = placement.fetch_from_store
            source = self.stores[placement.fetch_from_store]
            transfer = self.costs.predictors.transfer
            job.fetch_done_at = start_fetch(now, source, instance.store, placement, keys, transfer)
            job.is_fetch_pending = True
            self.push(job.fetch_done_at, self.fetch_done_kind, job)
        instance.queue.append(job)
        instance.queued_prefill_s += placement.predicted_prefill_s
        self.try_start(now, instance)

    def on_fetch_done(self, now: float, job: PrefillJob) -> None:
        placement = job.placement
        instance = self.instances[placement.prefill_instance]
        finish_fetch(now, job, instance.store, self.stores[placement.fetch_from_store or ""])

    def try_start(self, now: float, instance: PrefillInstance) -> None:
        if instance.running or not instance.queue:
            return
        cluster = self.config.cluster
        batch = take_batch(instance.queue, cluster.max_batch_tokens, cluster.prefill_chunk,
                           is_one_at_a_time=instance.pipeline is not None)
        model = prefill_model(instance.view(), self.policy)  # a group's follows its pipeline
        start = now
        for job in batch:
            instance.queued_prefill_s = max(0.0, instance.queued_prefill_s - job.placement.predicted_prefill_s)
            job.started_at = now
            num_device = 0
            if instance.device is not None:
                num_device = instance.device.start_prompt(job.request_index, job.keys, job.num_prompt_tokens,
                                                          self.config.scheduler.block_size)
            num_prefix_blocks = reusable_blocks_at_start(instance.store, job, num_device)
            self.records[job.request_index].prefix_blocks = num_prefix_blocks
            self.records[job.request_index].device_blocks = num_device
            prefix_tokens = min(num_prefix_blocks * self.config.scheduler.block_size, job.num_prompt_tokens - 1)
            job.compute_s = self.noisy(model.predict(job.num_prompt_tokens, max(prefix_tokens, 0)))
            start = max(start, job.fetch_done_at)
        instance.running = batch
        instance.busy_until = start + sum(job.compute_s for job in batch)
        self.push(instance.busy_until, self.prefill_done_kind, instance)

    def noisy(self, compute_s: float) -> float:
        """A true prefill time: the prediction times `run.prefill_noise`'s log-normal factor."""
        noise = self.config.run.prefill_noise
        return compute_s * self.rng.lognormvariate(0.0, noise) if noise > 0 else compute_s

    def on_prefill_done(self, now: float, instance: PrefillInstance) -> None:
        batch = instance.running
        instance.busy_time_done += now - batch[0].started_at
        instance.running = []
        for job in batch:
            instance.store.put(job.keys, now)
            instance.store.cache.unlock(job.locked_keys)
            if instance.device is not None:
                instance.device.finish(job.request_index, job.keys)
            record = self.records[job.request_index]
            record.prefill_compute_s = job.compute_s
            record.ttft_s = now - record.arrival_s
        self.try_start(now, instance)
        for job in batch:
            self.on_prefilled(now, job, self.records[job.request_index])
