"""Registered host buffers for the hidden states a prefill group's stages hand each other, one chunk per slot.

1. `HiddenSlots(engine, name, num_slots, chunk_tokens, hidden_size, dtype, pin)` allocates one buffer
   [num_slots, chunk_tokens, hidden_size] (pinned host memory when the model is on CUDA) and registers it with
   the transfer engine once as segment `name`: peers read a slot by (endpoint, name, `offset(slot)`).
2. A sender's compute thread `acquire`s a slot (blocking until one is free, the deadline passes or the caller's
   run is stopped), copies chunk j's hidden states into it and posts the CPP_CHUNK call; the event loop
   `release`s the slot once the next stage has read it. A receiver's event loop `acquire_async`s a slot, reads
   the chunk into it and `release`s it once the chunk's forward has run.
3. `wake()` lets blocked acquirers re-check whether their run was stopped; `close()` unregisters the buffer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from mooncaked.transfer import SegmentRef, TransferEngine


class SlotTimeout(TimeoutError):
    """No hidden-state slot came free before the deadline."""


class HiddenSlots:
    """Owns one registered buffer of `num_slots` chunks and which slots are free (any thread may acquire and
    release; async waiters are woken on the loop that waits)."""

    def __init__(self, engine: TransferEngine, name: str, num_slots: int, chunk_tokens: int, hidden_size: int,
                 dtype: torch.dtype, *, pin: bool = False) -> None:
        self.engine = engine
        self.name = name
        self.num_slots = num_slots
        self.chunk_tokens = chunk_tokens
        self.hidden_size = hidden_size
        self.buffer = torch.empty((num_slots, chunk_tokens, hidden_size), dtype=dtype, pin_memory=pin)
        engine.register(name, self.buffer.view(-1).view(torch.uint8))
        self.segment = SegmentRef(engine.endpoint, name)
        self._free: deque[int] = deque(range(num_slots))
        self._cond = threading.Condition()
        self._async_waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    @property
    def slot_nbytes(self) -> int:
        return self.chunk_tokens * self.hidden_size * self.buffer.element_size()

    def offset(self, slot: int) -> int:
        return slot * self.slot_nbytes

    def nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.hidden_size * self.buffer.element_size()

    def view(self, slot: int, num_tokens: int) -> torch.Tensor:
        """[num_tokens, hidden_size] at the start of `slot`."""
        return self.buffer[slot, :num_tokens]

    def acquire(self, deadline: float, is_stopped: Callable[[], bool]) -> int | None:
        """A free slot (blocking; any thread but the event loop's), or None once `is_stopped()` holds;
        SlotTimeout past `deadline` (time.monotonic())."""
        with self._cond:
            while not self._free:
                if is_stopped():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SlotTimeout(f"no free hidden-state slot of {self.name} before the deadline")
                self._cond.wait(left)
            return None if is_stopped() else self._free.popleft()

    async def acquire_async(self, timeout_s: float) -> int:
        """A free slot (event loop); SlotTimeout after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self._cond:
                if self._free:
                    return self._free.popleft()
                waiter: asyncio.Future[None] = loop.create_future()
                self._async_waiters.append((loop, waiter))
            try:
                await asyncio.wait_for(waiter, max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise SlotTimeout(f"no free hidden-state slot of {self.name} within {timeout_s:g}s") from None

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots
        with self._cond:
            assert slot not in self._free, f"slot {slot} of {self.name} released twice"
            self._free.append(slot)
            self._cond.notify()
            waiters, self._async_waiters = self._async_waiters, deque()
        for loop, waiter in waiters:  # each re-checks the free list: one gets the slot, the rest wait again
            loop.call_soon_threadsafe(_resolve, waiter)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        self.engine.unregister(self.name)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
