"""Whether a decode instance takes a RESERVE call now, and the calls waiting for room (role.py, step 1).

1. refusal: the instance's load now (free pages and reserved ones, running and reserved requests, their
   context) under the admission policy: `sched.decode_admission.reserve_refusal`, the rule the simulator runs
   too; "" takes the call.
2. Under `none` and `baseline` (WAITING_POLICIES) a refused call, or any call while others wait, waits for room
   up to its deadline (wait_for_room), expiring stale reservations meanwhile; waiting calls take room in queue
   order: interactive first, then priority, then arrival (sched/priority.py); the book's `Room` wakes them.
3. A call that gives up wakes the calls behind it; a granted one wakes them once it reserved (role.py).
"""

from __future__ import annotations

import time

from mooncaked.config import Config
from mooncaked.roles.worker.decode.loop import DecodeLoop
from mooncaked.roles.worker.decode.reservations import ReservationBook
from mooncaked.roles.worker.messages import ReserveRequest
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext
from mooncaked.sched.decode_admission import DecodeLoadNow, StepLimit, reserve_refusal
from mooncaked.sched.priority import queue_rank


class ReserveAdmission:
    """Decides RESERVE calls. Owns the calls waiting for room (their queue ranks, by request id); the worker,
    the decode loop and the reservation book are the DecodeRole's."""

    def __init__(self, config: Config, worker: Worker, loop: DecodeLoop, reservations: ReservationBook) -> None:
        self.config = config
        self.worker = worker
        self.loop = loop
        self.reservations = reservations
        self.waiting: dict[str, tuple[int, int, float]] = {}  # RESERVE calls waiting for room: their queue rank

    def step_limit(self) -> StepLimit:
        return StepLimit(self.worker.perf.decode, self.loop.mean_step_s, self.config.scheduler.tbt_slo_ms / 1000)

    def refusal(self, request: ReserveRequest, num_pages: int) -> str:
        pages = self.worker.pages
        assert pages is not None
        book = self.reservations
        load = DecodeLoadNow(pages.num_free - book.num_pages(), len(self.loop.running) + book.num_sequences(),
                             self.loop.num_context_tokens + book.num_prompt_tokens())
        return reserve_refusal(self.config.scheduler.admission, load, num_pages, request.num_prompt_tokens,
                               self.worker.section.max_batch_size, self.step_limit(), request.num_sequences)

    async def wait_for_room(self, request: ReserveRequest, num_pages: int, ctx: CallContext) -> str:
        """`none` and `baseline`: wait for room up to the call's deadline, expiring stale reservations meanwhile.
        Waiting calls take room in queue order (interactive first, then priority, then arrival)."""
        rank = queue_rank(request.is_batch, request.priority, time.monotonic())
        self.waiting[request.request_id] = rank
        reason = "cancelled"
        try:
            while True:
                await self.reservations.expire()
                timeout_s = min(ctx.deadline, self.reservations.next_expiry(ctx.deadline)) - time.monotonic()
                reason = await self.reservations.room.wait_until(
                    lambda: self.refusal(request, num_pages) or self._behind(rank), max(timeout_s, 0.0))
                if not reason or ctx.time_left_s() <= 0:
                    return reason
        finally:
            del self.waiting[request.request_id]
            if reason:  # given up: the calls behind it look again (a granted one wakes them once it reserved)
                await self.reservations.room.freed()

    def _behind(self, rank: tuple[int, int, float]) -> str:
        num_ahead = sum(1 for other in self.waiting.values() if other < rank)
        return f"queued: {num_ahead} waiting requests go first" if num_ahead else ""
