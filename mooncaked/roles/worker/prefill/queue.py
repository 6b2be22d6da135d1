"""A prefill instance's queue: its jobs and which of them the next forward takes.

1. A PREFILL call whose KV is planned becomes a PrefillJob and joins the queue (prefill.PrefillRole owns both).
2. take_batch orders the queue by class, priority and arrival (sched/priority.py) and takes jobs while they fit
   `max_batch_tokens`; a prompt longer than `prefill_chunk` runs alone (in chunks), a batch line never joins an
   interactive prompt's forward, and a prefill group's first stage takes one prompt at a time.
3. The taken jobs run (prefill.PrefillRole._run_batch); their counts key the performance model (`prompt`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mooncaked.config import WorkerSection
from mooncaked.roles.worker.kv.plan import KvPlan
from mooncaked.roles.worker.messages import PrefillReply, PrefillRequest
from mooncaked.sched.priority import queue_rank


@dataclass
class PrefillJob:
    """One queued or running prefill; owned by the PrefillRole while it is queued or running."""

    request: PrefillRequest
    plan: KvPlan
    arrived_at: float  # the PREFILL call's arrival (before planning its KV)
    enqueued_at: float
    future: asyncio.Future[PrefillReply]
    deadline: float = 0.0  # the PREFILL call's (time.monotonic())
    is_running: bool = False
    started_at: float = 0.0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_prefix_tokens(self) -> int:
        return self.plan.num_prefix_blocks * self.plan.kv.worker.block_size

    @property
    def num_new_tokens(self) -> int:
        return self.plan.kv.num_tokens - self.num_prefix_tokens

    @property
    def prompt(self) -> tuple[int, int]:
        """(prompt tokens, reused prefix tokens): what the performance model is keyed by."""
        return self.plan.kv.num_tokens, self.num_prefix_tokens


def take_batch(queue: list[PrefillJob], section: WorkerSection, *, is_one_at_a_time: bool) -> list[PrefillJob]:
    """The next forward's jobs, removed from `queue` (the caller's); is_one_at_a_time: a prefill group's."""
    batch: list[PrefillJob] = []
    num_tokens = 0
    for job in sorted(queue, key=_queue_rank):
        if batch and is_one_at_a_time:
            break  # a group runs one prompt at a time: its stages pipeline the chunks, and the prompts
        if batch and (job.num_new_tokens > section.prefill_chunk
                      or num_tokens + job.num_new_tokens > section.max_batch_tokens
                      or job.request.sampling.is_batch > batch[0].request.sampling.is_batch):
            break  # a batch line never lengthens an interactive prompt's forward
        batch.append(job)
        queue.remove(job)
        num_tokens += job.num_new_tokens
        if job.num_new_tokens > section.prefill_chunk:
            break
    return batch


def _queue_rank(job: PrefillJob) -> tuple[int, int, float]:
    return queue_rank(job.request.sampling.is_batch, job.request.sampling.priority, job.enqueued_at)
