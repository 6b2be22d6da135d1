"""A prefill instance's queue: its jobs and which of them the next forward takes.

1. A PREFILL call whose KV is planned becomes a PrefillJob and joins the queue (prefill.PrefillRole owns both).
2. `sched.prefill_batch.take_batch` (the rule the simulator runs too) picks the next forward's jobs: by class,
   priority and arrival, while they fit `max_batch_tokens`.
3. The taken jobs run (batch.BatchRunner.run); their counts key the performance model (`prompt`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mooncaked.model.grammar import GrammarState
from mooncaked.roles.worker.kv.plan import KvPlan
from mooncaked.roles.worker.messages import PrefillReply, PrefillRequest


@dataclass
class PrefillJob:
    """One queued or running prefill; owned by the PrefillRole while it is queued, by its BatchRunner while it runs."""

    request: PrefillRequest
    plan: KvPlan
    arrived_at: float  # the PREFILL call's arrival (before planning its KV)
    enqueued_at: float
    future: asyncio.Future[PrefillReply]
    deadline: float = 0.0  # the PREFILL call's (time.monotonic())
    is_running: bool = False
    grammars: list[GrammarState | None] = field(default_factory=list)  # per sequence, rebuilt on arrival
    started_at: float = 0.0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_prefix_tokens(self) -> int:
        return self.plan.num_prefix_blocks * self.plan.kv.worker.block_size

    @property
    def num_new_tokens(self) -> int:
        return self.plan.kv.num_tokens - self.num_prefix_tokens

    @property
    def is_batch(self) -> bool:
        return self.request.sampling.is_batch

    @property
    def priority(self) -> int:
        return self.request.sampling.priority

    @property
    def prompt(self) -> tuple[int, int]:
        """(prompt tokens, reused prefix tokens): what the performance model is keyed by."""
        return self.plan.kv.num_tokens, self.num_prefix_tokens
