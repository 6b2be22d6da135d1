"""A later stage of a prefill group: its layers of every prompt the group's first stage sends it.

1. CPP_STAGE opens a prompt here (roles/worker/group/stage_job.py): the request is checked against this stage (group,
   layers, chunk size, length), pages for its tokens are allocated (for this stage's layers), and the reused prefix
   starts loading layer by layer from the stores that hold it. The first stream item says the stage is ready
   for chunks.
2. CPP_CHUNK: chunks are taken in one order (prompts as they were opened, chunks in index order), so a chunk
   never holds a receive slot another one needs first: a call waits for its turn, reads the previous stage's
   hidden states into a free slot through the transfer engine, queues the chunk and replies (the sender's slot
   is then free).
3. The chunk loop runs the queued chunks one by one on the compute thread (forward.run_chunk): the first
   chunk waits for each layer's prefix, the last one queues each layer's new KV for the group's store and the
   decode host right after computing it (each block object's slice of this stage's layers). Every stage but
   the last hands its output to the next stage (ChunkSender); the last samples the first token.
4. After the last chunk: every chunk sent on has been read and every write confirmed, then the second item (the
   first token, from the last stage). The first stage commits the blocks only after every stage said so.
5. CPP_ABORT, the stream's cancellation or a failure stops the prompt: nothing more is computed or sent, the
   compute thread leaves it at its next layer boundary, in-flight writes settle, pages are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from mooncaked.config.prefill_groups import GroupStage, NUM_HIDDEN_SLOTS
from mooncaked.roles.base import RoleEndpoint
from mooncaked.roles.worker.group.forward import ChunkSender, run_chunk
from mooncaked.roles.worker.group.hidden_slots import HiddenSlots
from mooncaked.roles.worker.group.messages import (CPP_ABORT, CPP_CHUNK, CPP_STAGE, ChunkReply, ChunkRequest,
                                                   StageAbort, StageAbortReply, StageItem, StageRequest)
from mooncaked.roles.worker.group.stage_job import StageFailed, StageJob, check_request, num_prefix_tokens, open_job
from mooncaked.roles.worker.prefill.forward import PrefillCancelled
from mooncaked.roles.worker.sampling import generator_at, history_of, sample_rows, to_params
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext, Cancelled, InvalidArgument, RpcError, Unavailable
from mooncaked.runtime.logs import request_id_var
from mooncaked.runtime.supervised import start_supervised, stop_task
from mooncaked.sched.perf_model import RecentMean
from mooncaked.transfer import SegmentRef, TransferOp, TransferRequest

logger = logging.getLogger(__name__)


class StageService:
    """The CPP methods of a group member after the first. Owns its jobs (by request id), the receive slots, the
    send slots (every stage but the last), the queue of received chunks and the chunk loop task."""

    def __init__(self, worker: Worker, endpoint: RoleEndpoint) -> None:
        self.worker = worker
        self.jobs: dict[str, StageJob] = {}
        self._receiving: deque[StageJob] = deque()  # opened jobs with chunks still to receive, in open order
        self._turn = asyncio.Condition()
        self._received: asyncio.Queue[tuple[StageJob, int, int]] = asyncio.Queue()
        self.receive_slots: HiddenSlots | None = None
        self.send_slots: HiddenSlots | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self.handoff = RecentMean()  # seconds to read one chunk's hidden states from the previous stage
        endpoint.add_method(CPP_STAGE, self._stage)
        endpoint.add_method(CPP_CHUNK, self._chunk)
        endpoint.add_method(CPP_ABORT, self._abort, is_eager=True)

    @property
    def stage(self) -> GroupStage:
        assert self.worker.stage is not None
        return self.worker.stage

    async def start(self) -> None:
        """After the worker started: the slots need its engine and model."""
        worker, loaded = self.worker, self.worker.loaded
        assert loaded is not None
        chunk_tokens, name = worker.section.cpp_chunk_tokens, worker.instance.name
        is_pinned = loaded.device.type == "cuda"
        hidden = loaded.args.hidden_size
        self.receive_slots = HiddenSlots(worker.engine, f"{name}/cpp-receive", NUM_HIDDEN_SLOTS, chunk_tokens,
                                         hidden, loaded.dtype, pin=is_pinned)
        if not self.stage.is_last:
            self.send_slots = HiddenSlots(worker.engine, f"{name}/cpp-send", NUM_HIDDEN_SLOTS, chunk_tokens,
                                          hidden, loaded.dtype, pin=is_pinned)
        self._loop_task = start_supervised("cpp-chunk-loop", self._chunk_loop, on_failure=self._loop_failed)

    async def stop(self) -> None:
        for job in list(self.jobs.values()):
            job.fail(Unavailable(f"{self.worker.instance.name} is stopping"))
        task, self._loop_task = self._loop_task, None
        await stop_task(task)
        for slots in (self.receive_slots, self.send_slots):
            if slots is not None:
                slots.wake()
                slots.close()

    def _loop_failed(self, reason: str) -> None:
        """The chunk loop failed: every open prompt fails, and the worker is marked failed (it is restarted)."""
        self.worker.fail(reason)
        for job in list(self.jobs.values()):
            job.fail(Unavailable(f"{self.worker.instance.name} failed ({reason})"))

    @property
    def is_idle(self) -> bool:
        return not self.jobs

    # ---- CPP_STAGE -----------------------------------------------------------------------------------------
    async def _stage(self, request: StageRequest, ctx: CallContext) -> AsyncIterator[StageItem]:
        request_id_var.set(request.request_id)
        job = self._open(request, ctx.deadline)
        try:
            yield StageItem(is_done=False)
            await self._until_computed(job)
            if job.sender is not None:
                await job.sender.wait_sent()
            await job.kv.wait_writes(max(job.deadline - time.monotonic(), 0.001))
            self.worker.perf.add_prefill(request.num_tokens, num_prefix_tokens(self.worker, request), job.compute_s)
            yield StageItem(is_done=True, first_token=job.first_token, compute_s=job.compute_s)
        finally:
            await self._close(job)

    def _open(self, request: StageRequest, deadline: float) -> StageJob:
        check_request(self.worker, self.stage, request, self.jobs)
        job = open_job(self.worker, request, deadline)
        if self.send_slots is not None:
            client = self.worker.peers.for_instance(self.worker.member_instance(self.stage.next_member))
            job.sender = ChunkSender(self.worker, self.send_slots, client, request.request_id, deadline,
                                     lambda exc: job.fail(_failure(self.stage.next_member, exc)),
                                     lambda: job.is_cancelled)
        job.kv.start_loading(request.sources, request.num_prefix_blocks)
        self.jobs[request.request_id] = job
        self._receiving.append(job)
        return job

    async def _until_computed(self, job: StageJob) -> None:
        try:
            await asyncio.wait_for(job.computed.wait(), max(job.deadline - time.monotonic(), 0.001))
        except TimeoutError:
            job.fail(StageFailed(f"{job.request_id}: not computed before the deadline "
                                 f"({job.num_received}/{len(job.chunks)} chunks received)"))
        if job.error is not None:
            raise job.error
        if not job.kv.is_failed:
            return
        job.kv.raise_failure()

    async def _close(self, job: StageJob) -> None:
        """Stop the job and give back what it holds; its writes settle before its pages are freed."""
        if not job.computed.is_set() or job.error is not None:
            job.fail(job.error or Cancelled(f"{job.request_id} was stopped"))
        await self._leave_turns(job)
        for slots in (self.send_slots, self.receive_slots):
            if slots is not None:
                slots.wake()
        await job.idle.wait()  # the compute thread left it (at its next layer boundary)
        if job.sender is not None:
            await job.sender.settle()
        await job.kv.settle_writes(self.worker.config.transfer.timeout_s)
        await job.kv.release()
        self.jobs.pop(job.request_id, None)

    async def _leave_turns(self, job: StageJob) -> None:
        async with self._turn:
            if job in self._receiving:
                self._receiving.remove(job)
            self._turn.notify_all()

    async def _abort(self, request: StageAbort, ctx: CallContext) -> StageAbortReply:
        job = self.jobs.get(request.request_id)
        if job is None:
            return StageAbortReply(was_running=False)
        logger.info("%s: aborted by the first stage: %s", request.request_id, request.reason or "no reason given")
        job.fail(StageFailed(f"{request.request_id} was aborted: {request.reason}"))
        for slots in (self.send_slots, self.receive_slots):
            if slots is not None:
                slots.wake()
        return StageAbortReply(was_running=True)

    # ---- CPP_CHUNK -----------------------------------------------------------------------------------------
    async def _chunk(self, request: ChunkRequest, ctx: CallContext) -> ChunkReply:
        job = self.jobs.get(request.request_id)
        if job is None or job.is_cancelled:
            raise Unavailable(f"prompt {request.request_id!r} is not open on {self.worker.instance.name}")
        if not 0 <= request.chunk_index < len(job.chunks) or \
                request.num_tokens != len(job.chunks[request.chunk_index].token_ids):
            error = InvalidArgument(f"chunk {request.chunk_index} of {request.num_tokens} tokens does not match the "
                                    f"prompt's {len(job.chunks)} chunks of {job.request.chunk_tokens}")
            job.fail(error)
            raise error
        await self._wait_turn(job, request.chunk_index, ctx)
        try:
            slot = await self._read(job, request, ctx)
        finally:
            await self._next_turn(job)
        self._received.put_nowait((job, request.chunk_index, slot))
        return ChunkReply()

    async def _wait_turn(self, job: StageJob, chunk_index: int, ctx: CallContext) -> None:
        def is_turn() -> bool:
            return job.is_cancelled or (bool(self._receiving) and self._receiving[0] is job
                                        and job.num_received == chunk_index)
        try:
            async with self._turn:
                await asyncio.wait_for(self._turn.wait_for(is_turn), max(ctx.time_left_s(), 0.001))
        except TimeoutError:
            job.fail(StageFailed(f"chunk {chunk_index} of {job.request_id} waited past its deadline for its turn"))
            raise
        if job.is_cancelled:
            raise Unavailable(f"prompt {job.request_id!r} was stopped on {self.worker.instance.name}")

    async def _next_turn(self, job: StageJob) -> None:
        async with self._turn:
            job.num_received += 1
            if job.num_received == len(job.chunks) and job in self._receiving:
                self._receiving.remove(job)
            self._turn.notify_all()

    async def _read(self, job: StageJob, request: ChunkRequest, ctx: CallContext) -> int:
        """The chunk's hidden states from the sender's segment into a free receive slot of ours."""
        slots = self.receive_slots
        assert slots is not None
        num_bytes = slots.nbytes(request.num_tokens)
        slot = await slots.acquire_async(max(ctx.time_left_s(), 0.001))
        engine = self.worker.engine
        try:
            started = time.monotonic()
            remote = _segment(request)
            batch_id = engine.submit([TransferRequest(TransferOp.READ, slots.name, slots.offset(slot), remote,
                                                      request.offset, num_bytes)])
            await engine.wait(batch_id, max(ctx.time_left_s(), 0.001))
            self.handoff.add(time.monotonic() - started)
        except Exception as exc:
            slots.release(slot)
            job.fail(StageFailed(f"reading chunk {request.chunk_index} of {job.request_id} failed: {exc}"))
            raise Unavailable(f"reading chunk {request.chunk_index} failed on {self.worker.instance.name}: "
                              f"{exc}") from None
        return slot

    # ---- the chunk loop ------------------------------------------------------------------------------------
    async def _chunk_loop(self) -> None:
        slots = self.receive_slots
        assert slots is not None
        while True:
            job, index, slot = await self._received.get()
            try:
                if not job.is_cancelled:
                    await self._compute(job, index, slot)
            finally:
                slots.release(slot)

    async def _compute(self, job: StageJob, index: int, slot: int) -> None:
        job.idle.clear()
        try:
            await self.worker.compute(self._run_chunk, job, index, slot)
        except PrefillCancelled:
            job.fail(job.error or Cancelled(f"{job.request_id} was stopped"))
        except Exception as exc:
            logger.warning("%s: chunk %d failed on this stage: %s", job.request_id, index, exc)
            job.fail(exc if isinstance(exc, RpcError) else StageFailed(f"chunk {index} failed: "
                                                                       f"{type(exc).__name__}: {exc}"))
        finally:
            job.idle.set()
        job.num_computed += 1
        if job.num_computed == len(job.chunks):
            job.computed.set()

    def _run_chunk(self, job: StageJob, index: int, slot: int) -> None:
        """Compute thread."""
        slots = self.receive_slots
        assert slots is not None
        chunk = job.chunks[index]
        hidden_in = slots.view(slot, len(chunk.token_ids))
        is_last_chunk = index == len(job.chunks) - 1
        started = time.monotonic()
        out = run_chunk(self.worker, job, chunk, hidden_in, is_first_chunk=index == 0, is_last_chunk=is_last_chunk)
        job.compute_s += time.monotonic() - started  # the forward only: not the wait for a free send slot
        if job.sender is not None:
            job.sender.send(index, out)
        elif is_last_chunk:
            spec = job.request.sampling
            params = to_params(spec, self.worker.vocab_size)
            job.first_token = sample_rows(self.worker, out, [params], [generator_at(params, spec.num_sampled)],
                                          [history_of(job.request.token_ids, params, spec.num_sampled)],
                                          [job.grammar])[0]


def _segment(request: ChunkRequest) -> SegmentRef:
    return SegmentRef(request.endpoint, request.segment)


def _failure(member: str, exc: Exception) -> Exception:
    return Unavailable(f"handing hidden states to {member} failed: {exc}")

