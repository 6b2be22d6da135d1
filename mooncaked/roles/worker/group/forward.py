"""One chunk of a prompt through one stage of a prefill group, and handing its hidden states to the next stage.

1. `run_chunk` (compute thread): chunk j of the new tokens through this stage's layers, with the layer callbacks
   of a single instance's forward (roles/worker/prefill/forward.py): the first chunk waits for each layer's prefix KV,
   the last one queues each layer's new KV for its destinations right after computing it. The first stage embeds
   the chunk's tokens, the others start from the previous stage's hidden states; every stage but the last
   returns hidden states [T, hidden], the last one the logits of the chunk's last token.
2. `ChunkSender.send` (compute thread) copies the hidden states into a free registered slot and posts the
   CPP_CHUNK call, then returns: the next stage reads chunk j while this one computes chunk j+1. The slot is
   freed when the call returns (the next stage has the bytes). A failed call fails the prompt's run.
3. `await sender.wait_sent()` (event loop) once the last chunk is computed: every chunk has been read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable

import torch

from mooncaked.engine.batch import PrefillSeq, build_prefill_batch
from mooncaked.roles.worker.group.hidden_slots import HiddenSlots
from mooncaked.roles.worker.group.messages import CPP_CHUNK, ChunkRequest
from mooncaked.roles.worker.prefill.forward import ForwardPlan, after_layer, before_layer
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import RpcClient, RpcError


def run_chunk(worker: Worker, plan: ForwardPlan, chunk: PrefillSeq, hidden_in: torch.Tensor | None, *,
              is_first_chunk: bool, is_last_chunk: bool) -> torch.Tensor:
    """Compute thread: hidden [T, hidden] after this stage's layers, or on the last stage logits fp32 [1, vocab]
    of the chunk's last token. `hidden_in` [T, hidden] (host or device) for every stage but the first."""
    runner, kv_pages = worker.runner, worker.kv_pages
    assert runner is not None and kv_pages is not None and worker.stage is not None
    batch = build_prefill_batch([chunk], block_size=worker.block_size, num_pages=kv_pages.num_pages,
                                device=kv_pages.device)
    if hidden_in is not None:
        hidden_in = hidden_in.to(kv_pages.device, non_blocking=False)
    return runner.prefill(batch, hidden_in=hidden_in, return_hidden=not worker.stage.is_last,
                          before_layer=lambda i: before_layer(worker, [plan], i, is_first_chunk),
                          after_layer=lambda i: after_layer(worker, [plan], i, is_last_chunk))


class ChunkSender:
    """Owns the CPP_CHUNK calls of one prompt from this stage to the next, and the slots they hold until read."""

    def __init__(self, worker: Worker, slots: HiddenSlots, client: RpcClient, request_id: str, deadline: float,
                 on_failure: Callable[[Exception], None], is_stopped: Callable[[], bool]) -> None:
        self.worker = worker
        self.slots = slots
        self.client = client
        self.request_id = request_id
        self.deadline = deadline  # time.monotonic()
        self._on_failure = on_failure
        self._is_stopped = is_stopped
        self._calls: list[concurrent.futures.Future[None]] = []

    def send(self, chunk_index: int, hidden: torch.Tensor) -> None:
        """Compute thread: hand chunk `chunk_index`'s hidden [T, hidden] on (waits for a free slot)."""
        slot = self.slots.acquire(self.deadline, self._is_stopped)
        if slot is None:  # the run was stopped: nothing more goes out
            return
        num_tokens = int(hidden.shape[0])
        self.slots.view(slot, num_tokens).copy_(hidden)
        self._calls.append(self.worker.post(self._call(chunk_index, slot, num_tokens)))

    async def _call(self, chunk_index: int, slot: int, num_tokens: int) -> None:
        request = ChunkRequest(self.request_id, chunk_index, self.slots.segment.endpoint, self.slots.name,
                               self.slots.offset(slot), num_tokens)
        try:
            await self.client.call(CPP_CHUNK, request, timeout_s=max(self.deadline - time.monotonic(), 0.001))
        except RpcError as exc:
            self._on_failure(exc)
            raise
        finally:
            self.slots.release(slot)

    async def wait_sent(self) -> None:
        """Every chunk sent so far has been read by the next stage; raises the first failure."""
        calls, self._calls = self._calls, []
        if calls:
            timeout_s = max(self.deadline - time.monotonic(), 0.001)
            outcomes = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(c) for c in calls),
                                                             return_exceptions=True), timeout_s)
            failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failure is not None:
                raise failure

    async def settle(self) -> None:
        """Let the calls in flight end, well or not (their slots are then free again)."""
        calls, self._calls = self._calls, []
        if calls:  # their failures are the run's already (on_failure): gathered only to be retrieved
            await asyncio.gather(*(asyncio.wrap_future(c) for c in calls), return_exceptions=True)
