"""Which queued prefills the next forward of a prefill instance takes: the one rule that the prefill role and the
simulator both run.

1. The queue is ordered by class, priority and arrival (`sched.priority.queue_rank`): interactive before batch
   lines, then higher priority, then earlier.
2. `take_batch` takes jobs in that order while their new tokens fit `max_batch_tokens`; a prompt longer than
   `prefill_chunk` runs alone (in chunks), a batch line never joins an interactive prompt's forward (it would
   lengthen it), and a prefill group's first stage takes one prompt at a time (its stages pipeline the chunks).
3. The taken jobs leave the caller's queue; the caller runs them as one forward.

Pure: no I/O, no clock; a job is anything with the four fields of `QueuedPrefill`.
"""

from __future__ import annotations

from collections.abc import MutableSequence
from typing import Protocol, TypeVar

from mooncaked.sched.priority import queue_rank


class QueuedPrefill(Protocol):
    """What the rule reads of a queued prefill."""

    @property
    def num_new_tokens(self) -> int: ...  # prompt tokens less the reused prefix: what the forward computes

    @property
    def is_batch(self) -> bool: ...  # a Batch API line (the batch class)

    @property
    def priority(self) -> int: ...

    @property
    def enqueued_at(self) -> float: ...


Job = TypeVar("Job", bound=QueuedPrefill)


def take_batch(queue: MutableSequence[Job], max_batch_tokens: int, prefill_chunk: int, *,
               is_one_at_a_time: bool) -> list[Job]:
    """The next forward's jobs, removed from `queue` (the caller's); is_one_at_a_time: a prefill group's."""
    batch: list[Job] = []
    num_tokens = 0
    for job in sorted(queue, key=lambda j: queue_rank(j.is_batch, j.priority, j.enqueued_at)):
        if batch and is_one_at_a_time:
            break
        if batch and (job.num_new_tokens > prefill_chunk
                      or num_tokens + job.num_new_tokens > max_batch_tokens
                      or job.is_batch > batch[0].is_batch):
            break
        batch.append(job)
        queue.remove(job)
        num_tokens += job.num_new_tokens
        if job.num_new_tokens > prefill_chunk:
            break
    return batch
