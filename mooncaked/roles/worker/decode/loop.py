"""Continuous batching on a decode instance: every step advances every running sequence by one token.

1. `add(seq)` puts a sequence (its KV already in pages, its first token sampled) into the running batch;
   the loop wakes up. A sequence joins between steps, never inside one.
2. A step runs on the compute thread: one decode forward over the whole batch (the grammar masks of constrained
   sequences computed meanwhile on the mask thread), then one sample per row.
   Each sequence gets its token through its own queue; finished sequences leave the batch. The step's time
   (batch size, context) is a live sample of the worker's performance model.
3. `remove(seq)` takes a sequence out (finished, or its client went away); it returns once no step uses the
   sequence's pages any more, so the caller may free them.
4. `stop()` cancels the loop task and awaits it; sequences still running get a final Unavailable through their
   queues (the conductor migrates them: mid-stream failover).
5. The loop task is supervised (runtime/supervised.py): an unexpected exception outside a step is logged, the
   running sequences get Unavailable at once, and the worker is marked failed (the role stops, exits non-zero
   and is restarted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mooncaked.engine.batch import DecodeSeq, build_decode_batch
from mooncaked.model.grammar import GrammarState
from mooncaked.model.sampling_params import SamplingParams
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.roles.worker.messages import FINISH_EOS, FINISH_LENGTH, TokenSample
from mooncaked.roles.worker.sampling import history_of, reseed, sample_rows
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import Unavailable
from mooncaked.runtime.supervised import start_supervised, stop_task

logger = logging.getLogger(__name__)


Outbox = asyncio.Queue[tuple[int, TokenSample, str] | BaseException]  # (sequence, token, finish reason) or failure


@dataclass
class RunningSeq:
    """One sequence in the batch; its token list is appended to only by the loop."""

    request_id: str
    kv: RequestKv
    token_ids: list[int]  # prompt + generated; the last one's KV is not in pages yet
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    outbox: Outbox = field(default_factory=asyncio.Queue)  # a parallel sampling's sequences share their call's
    finish_reason: str = ""
    num_sampled_before: int = 0  # output tokens sampled before this leg (the request's seed state)
    predicted_num_tokens: int = 0  # output tokens the conductor predicted for this leg (0: none)
    grammar: GrammarState | None = None  # constrained decoding: advanced by the loop's compute step
    sequence: int = 0  # its place in a parallel sampling

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def is_stop_token(params: SamplingParams, token_id: int, eos_token_ids: tuple[int, ...]) -> bool:
    return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids)


def finish_reason_for(seq: RunningSeq, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> str:
    """Why `seq` ends after `token_id` was appended ("" if it goes on)."""
    params = seq.params
    if is_stop_token(params, token_id, eos_token_ids):
        return FINISH_EOS
    if seq.grammar is not None and seq.grammar.is_done:  # the constrained output is complete
        return FINISH_EOS
    if seq.num_generated >= params.max_tokens or len(seq.token_ids) >= max_model_len:
        return FINISH_LENGTH
    return ""


class DecodeLoop:
    """Owns the running batch, the loop task and the step-time estimate."""

    def __init__(self, worker: Worker, on_step: Callable[[int, float], None] = lambda num_seqs, step_s: None) -> None:
        self.worker = worker
        self.on_step = on_step
        self.running: list[RunningSeq] = []
        self._in_step: list[RunningSeq] = []
        self._step_done = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.mean_step_s = 0.0
        self.num_steps = 0

    def start(self) -> None:
        self._task = start_supervised("decode-loop", self._run, on_failure=self._loop_failed)

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        self._end_running(f"{self.worker.instance.name} stopped decoding (stopping or switching role); continue the "
                          "request elsewhere")

    def _loop_failed(self, reason: str) -> None:
        self.worker.fail(reason)
        self._end_running(f"{self.worker.instance.name} failed ({reason}); continue the request elsewhere")

    def _end_running(self, why: str) -> None:
        for seq in self.running:
            seq.outbox.put_nowait(Unavailable(why))
        self.running = []

    def add(self, seq: RunningSeq) -> None:
        self.running.append(seq)
        self._wakeup.set()

    async def remove(self, seq: RunningSeq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        while seq in self._in_step:
            self._step_done.clear()
            await self._step_done.wait()

    @property
    def num_context_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.running)

    async def _run(self) -> None:
        last_done: float | None = None  # when the previous step ended, while the loop has not idled since
        while True:
            if not self.running:
                self._wakeup.clear()
                await self._wakeup.wait()
                last_done = None
                continue
            batch = list(self.running)
            self._in_step = batch
            num_context_tokens = sum(len(seq.token_ids) for seq in batch)
            try:
                samples, step_s = await self._compute(batch)
            except Exception as exc:
                logger.exception("decode step over %d sequences failed", len(batch))
                self._fail(batch, exc)
                continue
            finally:
                self._in_step = []
                self._step_done.set()
            self._observe(step_s)
            done = time.monotonic()
            self.worker.perf.add_decode(len(batch), num_context_tokens, step_s)
            if last_done is not None:  # the gap a client sees between tokens: the step and what ran before it
                self.worker.perf.observe_decode_interval(len(batch), num_context_tokens, done - last_done)
            last_done = done
            self.on_step(len(batch), step_s)
            self._deliver(batch, samples)

    async def _compute(self, batch: list[RunningSeq]) -> tuple[list[TokenSample], float]:
        """One step on the compute thread; cancelled (stop), it still waits for the thread to leave the step, so
        no page of the batch is freed while the step reads it."""
        step = asyncio.ensure_future(self.worker.compute(self._step, batch))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            await asyncio.wait([step])
            raise

    def _observe(self, step_s: float) -> None:
        self.num_steps += 1
        self.mean_step_s = step_s if self.num_steps == 1 else 0.9 * self.mean_step_s + 0.1 * step_s

    def _step(self, batch: list[RunningSeq]) -> tuple[list[TokenSample], float]:
        """Compute thread: one token for every sequence of `batch`, and the step's own time (no queueing
        behind inline prefills or KV loads on the same thread: that would inflate TBT predictions)."""
        started = time.monotonic()
        worker = self.worker
        assert worker.runner is not None and worker.kv_pages is not None
        assert worker.grammar is not None
        masks = worker.grammar.masks([s.grammar for s in batch])  # computed while the forward runs
        seqs = [DecodeSeq(token_id=s.token_ids[-1], num_cached_tokens=len(s.token_ids) - 1, page_ids=s.kv.page_ids)
                for s in batch]
        decode_batch = build_decode_batch(seqs, block_size=worker.block_size, num_pages=worker.kv_pages.num_pages,
                                          device=worker.kv_pages.device)
        logits = worker.runner.decode(decode_batch)
        for seq in batch:
            reseed(seq.generator, seq.params, seq.num_sampled_before + seq.num_generated)
        histories = [history_of(s.token_ids, s.params, s.num_sampled_before + s.num_generated) for s in batch]
        samples = sample_rows(worker, logits, [s.params for s in batch], [s.generator for s in batch], histories,
                              [s.grammar for s in batch], masks)
        return samples, time.monotonic() - started

    def _deliver(self, batch: list[RunningSeq], samples: list[TokenSample]) -> None:
        loaded = self.worker.loaded
        assert loaded is not None
        max_model_len = self.worker.config.model.max_model_len
        for seq, sample in zip(batch, samples):
            if seq not in self.running:
                continue  # removed during the step: its token is dropped
            seq.token_ids.append(sample.token_id)
            reason = finish_reason_for(seq, sample.token_id, loaded.eos_token_ids, max_model_len)
            seq.outbox.put_nowait((seq.sequence, sample, reason))
            if reason:
                seq.finish_reason = reason
                self.running.remove(seq)

    def _fail(self, batch: list[RunningSeq], exc: Exception) -> None:
        for seq in batch:
            if seq in self.running:
                self.running.remove(seq)
                seq.outbox.put_nowait(exc)
