"""The decode reservations' page queue (reservations.py) on the real page allocator: over random interleavings of
reserve, claim, finish and cancel, never more pages set aside than exist, each granted reservation holding exactly
its pages, and pages granted in queue order as soon as they free."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.config import WorkerSection
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.roles.worker.decode.reservations import Reservation, ReservationBook
from mooncaked.roles.worker.messages import ReserveRequest

NUM_PAGES = 24
MAX_BATCH_SIZE = 4

OPS = st.lists(st.one_of(
    st.tuples(st.just("reserve"), st.integers(1, NUM_PAGES // 2), st.booleans(), st.integers(-1, 1),
              st.integers(1, 2)),
    st.tuples(st.just("claim"), st.integers(0, 30)),
    st.tuples(st.just("finish"), st.integers(0, 30)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
), max_size=40)


def _check(book: ReservationBook, pages: PageAllocator, running: list[str]) -> None:
    assert pages.num_free >= 0 and pages.num_free + pages.num_used == pages.num_pages
    waiting: list[Reservation] = []
    for reservation in book.by_id.values():
        held = pages.pages_of(reservation.owner)
        if reservation.granted.is_set():
            assert len(held) == reservation.num_pages
        else:
            assert not held
            waiting.append(reservation)
    num_seqs = len(running) + sum(r.request.num_sequences for r in book.by_id.values() if r.granted.is_set())
    assert num_seqs <= MAX_BATCH_SIZE
    if waiting:  # the head of the queue is waiting only because it does not fit now
        head = min(waiting, key=lambda r: r.rank)
        assert head.num_pages > pages.num_free or num_seqs + head.request.num_sequences > MAX_BATCH_SIZE


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_random_interleavings_never_set_aside_more_pages_than_exist(ops: list[tuple[Any, ...]]) -> None:
    asyncio.run(_run(ops))


async def _run(ops: list[tuple[Any, ...]]) -> None:
    pages = PageAllocator(NUM_PAGES)
    section = dataclasses.replace(WorkerSection(), max_batch_size=MAX_BATCH_SIZE)
    # the two components the book uses of its worker: the page allocator and the worker section (no store:
    # inline-prefill reservations take no store space)
    worker: Any = SimpleNamespace(pages=pages, section=section, stores=SimpleNamespace(local=None))
    running: list[str] = []
    book = ReservationBook(worker, lambda: len(running))
    made: list[str] = []
    try:
        for op in ops:
            if op[0] == "reserve":
                _, num_pages, is_batch, priority, num_sequences = op
                request_id = f"r{len(made)}"
                made.append(request_id)
                request = ReserveRequest(request_id, [], num_pages * 16 - 8, 8, 600_000, is_inline_prefill=True,
                                         priority=priority, is_batch=is_batch, num_sequences=num_sequences)
                book.add(request, num_pages * num_sequences)  # each sequence its own pages
            elif op[0] == "claim" and made:
                reservation = book.get(made[op[1] % len(made)])
                if reservation is not None and reservation.granted.is_set() and not reservation.is_claimed:
                    reservation.is_claimed = True
                    request_id = reservation.request.request_id
                    num_each = reservation.num_pages // reservation.request.num_sequences
                    for sequence in range(reservation.request.num_sequences):  # as each sequence's RequestKv does
                        sequence_id = request_id if not sequence else f"{request_id}#{sequence}"
                        assert len(pages.transfer(reservation.owner, sequence_id, num_each)) == num_each
                        running.append(sequence_id)
                    await book.drop(request_id)  # its KV is loaded
            elif op[0] == "finish" and running:
                request_id = running.pop(op[1] % len(running))
                pages.free_owner(request_id)
                await book.pages_freed()
            elif op[0] == "cancel" and made:
                await book.drop(made[op[1] % len(made)], is_prefill_done=False)
            _check(book, pages, running)
    finally:
        await book.close()
    for request_id in running:
        pages.free_owner(request_id)
    assert pages.num_free == NUM_PAGES  # nothing leaked


async def test_a_waiting_reservation_is_woken_when_pages_free_and_gives_up_at_its_deadline() -> None:
    pages = PageAllocator(8)
    worker: Any = SimpleNamespace(pages=pages, section=WorkerSection(), stores=SimpleNamespace(local=None))
    book = ReservationBook(worker, lambda: 0)
    try:
        first = book.add(ReserveRequest("a", [], 100, 20, 600_000, is_inline_prefill=True), 8)
        second = book.add(ReserveRequest("b", [], 100, 20, 600_000, is_inline_prefill=True), 8)
        assert first.granted.is_set() and not second.granted.is_set()
        assert not await book.wait_granted(second, time.monotonic() + 0.01)  # times out: still no pages
        waiter = asyncio.ensure_future(book.wait_granted(second, time.monotonic() + 5.0))
        await asyncio.sleep(0)
        await book.drop("a")
        assert await asyncio.wait_for(waiter, 1.0) and pages.pages_of(second.owner)
    finally:
        await book.close()
    assert pages.num_free == 8
