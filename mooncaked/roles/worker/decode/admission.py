"""Whether a decode instance takes a RESERVE call, and the calls waiting for room (role.py, step 1).

1. refusal, by admission policy, over the rules in sched/ that the simulator runs too:
   - `early_rejection_predicted`: the pages and batch slots the instance is forecast to hold over the request's
     predicted decode life (`sched.decode_memory.forecast_refusal`): running sequences until their predicted end,
     reservations from their predicted decode start; a request that fits is accepted even while its pages are not
     free yet (it waits in the reservation book's page queue);
   - otherwise its load now (`sched.decode_admission.reserve_refusal`): free pages less those queued
     reservations need, running and reserved requests, their context; "" takes the call.
2. Under `none` and `baseline` (WAITING_POLICIES) a refused call, or any call while others wait, waits for room
   up to its deadline (wait_for_room), expiring stale reservations meanwhile; waiting calls take room in queue
   order: interactive first, then priority, then arrival (sched/priority.py); the book's `Room` wakes them.
3. A call that gives up wakes the calls behind it; a granted one wakes them once it reserved (role.py).
4. `allocate_store`: the store space for a reservation's prefilled KV. Under WAITING_POLICIES a full store (its
   space leased or being written, mostly by the prefills this instance's reservations wait for) is waited for
   too, up to the call's deadline, trying again whenever a reservation here lets go of its space and at least
   every STORE_RETRY_S (other holders release theirs unseen); the other policies refuse at once.
"""

from __future__ import annotations

import time

from mooncaked.config import Config
from mooncaked.roles.worker.decode.loop import DecodeLoop
from mooncaked.roles.worker.decode.reservations import Reservation, ReservationBook
from mooncaked.roles.worker.messages import ReserveRequest
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext, ResourceExhausted
from mooncaked.sched.decode_admission import WAITING_POLICIES, DecodeLoadNow, StepLimit, reserve_refusal
from mooncaked.sched.decode_memory import DecodeHold, forecast_refusal
from mooncaked.sched.priority import queue_rank


STORE_RETRY_S = 0.5  # the longest wait between two tries of a full store; a call answers this long before its deadline


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
        book, section = self.reservations, self.worker.section
        if self.config.scheduler.admission == "early_rejection_predicted":
            now, step_s = time.monotonic(), self.step_s()
            starts_at = now + request.decode_start_s
            num_tokens = request.predicted_output_tokens or request.max_tokens
            new = DecodeHold(num_pages, starts_at, starts_at + max(num_tokens, 1) * step_s, request.num_sequences)
            return forecast_refusal(new, self.holds(now, step_s), pages.num_pages, section.max_batch_size)
        load = DecodeLoadNow(pages.num_free - book.num_queued_pages(), len(self.loop.running) + book.num_sequences(),
                             self.loop.num_context_tokens + book.num_prompt_tokens())
        return reserve_refusal(self.config.scheduler.admission, load, num_pages, request.num_prompt_tokens,
                               section.max_batch_size, self.step_limit(), request.num_sequences)

    def step_s(self) -> float:
        """The predicted decode step now (the TBT SLO before anything was measured: a conservative guess)."""
        step_s = self.step_limit().predict(max(len(self.loop.running), 1), self.loop.num_context_tokens)
        return step_s if step_s > 0 else self.config.scheduler.tbt_slo_ms / 1000

    def holds(self, now: float, step_s: float) -> list[DecodeHold]:
        """Every sequence's pages over its predicted life: running ones until their predicted end, then the
        reservations'."""
        return self.running_holds(now, step_s) + self.reservations.holds(now, step_s)

    def running_holds(self, now: float, step_s: float) -> list[DecodeHold]:
        """The running sequences' pages until their predicted end (their predicted output, else max_tokens, less
        what they generated). The prompt pages a parallel sampling's sequences share count once, until the last
        of them is predicted to end."""
        holds = []
        shared: dict[str, tuple[int, float]] = {}  # request id -> (its sequences' shared pages, their last end)
        for seq in self.loop.running:
            num_tokens = min(seq.predicted_num_tokens or seq.params.max_tokens, seq.params.max_tokens)
            ends_at = now + max(num_tokens - seq.num_generated, 1) * step_s
            num_shared = seq.kv.num_sibling_pages
            holds.append(DecodeHold(len(seq.kv.page_ids) - num_shared, now, ends_at))
            if num_shared:
                shared[seq.request_id] = (num_shared, max(ends_at, shared.get(seq.request_id, (0, now))[1]))
        return holds + [DecodeHold(num_pages, now, ends_at, num_seqs=0) for num_pages, ends_at in shared.values()]

    def drain_s(self) -> float:
        """Predicted seconds until the running sequences end: what a switch out of decode would wait for."""
        now = time.monotonic()
        return max((hold.ends_at - now for hold in self.running_holds(now, self.step_s())), default=0.0)

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

    async def allocate_store(self, reservation: Reservation, ctx: CallContext) -> None:
        """The reservation's store space; ResourceExhausted when the store stays full (see the module docstring)."""
        room = self.reservations.room
        while True:
            since = room.num_changes
            try:
                await self.reservations.allocate(reservation)
                return
            except ResourceExhausted:
                await self.reservations.give_back_allocation(reservation)
                left_s = ctx.time_left_s() - STORE_RETRY_S
                if self.config.scheduler.admission not in WAITING_POLICIES or left_s <= 0:
                    raise
            await room.wait_changed(since, min(left_s, STORE_RETRY_S))
