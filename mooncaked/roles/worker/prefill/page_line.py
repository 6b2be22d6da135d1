"""A prefill instance's line for KV pages: a prompt whose pages are not free waits its turn instead of failing.

A prompt takes its pages on arrival (its cached prefix loads into them while it queues), so a queue of long prompts
can hold every page while the next one arrives. Refusing that one would answer 429 for work the instance finishes
in seconds; it waits in line instead:
1. `wait_turn` returns at once when nobody waits and the allocator has the pages free; otherwise the prompt joins
   the line (arrival order, so a long prompt is not passed over forever by short ones).
2. Pages freed by a finished prompt (`freed`) wake the head of the line, which returns once its pages are free;
   the caller allocates them before its next await (plan_prompt_kv allocates before its first), so nothing
   can take them in between.
3. A prompt still waiting at its deadline leaves the line with ResourceExhausted naming the pages it needed;
   `close` fails every waiter with Unavailable (the instance stops taking prefills).
`plan_in_line` is a PREFILL's way through: its turn, then its KV plan (roles/worker/kv/plan.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mooncaked.roles.worker.kv.plan import KvPlan, plan_prompt_kv
from mooncaked.roles.worker.kv.spans import num_blocks_for
from mooncaked.roles.worker.messages import PrefillRequest
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import ResourceExhausted, Unavailable


@dataclass(eq=False)
class PageWaiter:
    request_id: str
    num_tokens: int
    num_pages: int
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class PageLine:
    """Owns the prompts waiting for KV pages (owned by the PrefillRole); the allocator stays the worker's."""

    def __init__(self, num_free_pages: Callable[[], int], num_pages: int) -> None:
        self._num_free_pages = num_free_pages
        self.num_pages = num_pages
        self.waiting: list[PageWaiter] = []  # arrival order
        self._closed_why = ""

    def __len__(self) -> int:
        return len(self.waiting)

    async def wait_turn(self, request_id: str, num_tokens: int, num_pages: int, timeout_s: float) -> None:
        """Return when this prompt's `num_pages` are free and nobody ahead of it waits (steps 1-3)."""
        if self._closed_why:
            raise Unavailable(self._closed_why)
        if not self.waiting and self._num_free_pages() >= num_pages:
            return
        if num_pages > self.num_pages:  # it could never fit: plan_prompt_kv refuses it with the counts
            return
        waiter = PageWaiter(request_id, num_tokens, num_pages)
        self.waiting.append(waiter)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._closed_why:
                    raise Unavailable(self._closed_why)
                if self.waiting[0] is waiter and self._num_free_pages() >= num_pages:
                    return
                waiter.wakeup.clear()
                left_s = deadline - time.monotonic()
                try:
                    if left_s <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(waiter.wakeup.wait(), left_s)
                except TimeoutError:
                    raise ResourceExhausted(
                        f"not enough KV pages for {num_tokens} tokens: {num_pages} pages needed, "
                        f"{self._num_free_pages()} of {self.num_pages} free after waiting {timeout_s:.1f} s "
                        f"behind {self.waiting.index(waiter)} prompts") from None
        finally:
            self.waiting.remove(waiter)
            self.freed()  # the next in line may fit beside it, or be the head now

    def freed(self) -> None:
        """Pages came free (or the head left): the head of the line looks again."""
        if self.waiting:
            self.waiting[0].wakeup.set()

    def close(self, why: str) -> None:
        self._closed_why = why
        for waiter in self.waiting:
            waiter.wakeup.set()

    def reopen(self) -> None:
        self._closed_why = ""


async def plan_in_line(line: PageLine, worker: Worker, request: PrefillRequest, deadline: float) -> KvPlan:
    """Wait for the prompt's pages in line, then plan its KV (which takes them); the caller closes the plan and
    calls `line.freed()` after."""
    num_tokens = len(request.token_ids)
    await line.wait_turn(request.request_id, num_tokens, num_blocks_for(num_tokens, worker.block_size),
                         timeout_s=max(deadline - time.monotonic(), 0.0))
    try:
        return await plan_prompt_kv(worker, request.request_id, request.token_ids, request.block_keys,
                                    fetch_store=request.fetch_store, num_fetch_blocks=request.num_fetch_blocks,
                                    decode_store=request.decode_store, destinations=request.destinations,
                                    timeout_s=max(deadline - time.monotonic(), 0.001),
                                    key_isolation=request.key_isolation, tenant=request.tenant,
                                    reuses_prefix=request.sampling.num_prompt_logprobs is None)
    except BaseException:
        line.freed()  # what it took is given back
        raise
