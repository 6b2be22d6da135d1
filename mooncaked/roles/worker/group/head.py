"""The first stage of a prefill group: each prompt it is given runs through the group's pipeline (the paper's CPP).

1. PREFILL arrives at the first stage and is planned as on a single instance (roles/worker/kv/plan.py): the reused
   prefix, store space in this host's store for every block it lacks (the group's store), the decode destinations.
2. `PipelineRun.run`: CPP_STAGE opens the prompt on every later stage with where the prefix is and where each
   block's KV goes; each answers once it is ready for chunks (pages allocated, its layers of the prefix loading).
3. The prompt's new tokens are cut into chunks of `worker.cpp_chunk_tokens`; chunk j runs through this stage's
   layers on the compute thread while chunk j-1's hidden states are read by stage 2 (roles/worker/group/forward.py),
   and so on down the pipeline. Every stage queues its own layers' new KV for the group's store and the decode host
   right after computing each layer of the last chunk, into the same block objects at its layers' offsets.
4. Commit protocol: every later stage's second item says its chunks are computed and its writes confirmed (the
   last one carries the first token); only then does this stage confirm its own writes and reply, and the
   prefill role commits the blocks: a block object becomes visible only once every stage wrote its layers.
5. A stage that fails, cannot be reached or runs past the deadline fails the run: every other stage is told to
   stop (CPP_ABORT) and the run waits, within `transfer.timeout_s`, until they have settled their writes; the
   prefill role then aborts the blocks, frees the pages and answers Unavailable naming the stage, so the
   conductor places the request again elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from mooncaked.config.prefill_groups import GroupStage, NUM_HIDDEN_SLOTS
from mooncaked.engine.batch import split_prefill_chunks
from mooncaked.roles.worker.group.forward import ChunkSender, run_chunk
from mooncaked.roles.worker.group.hidden_slots import HiddenSlots
from mooncaked.roles.worker.group.messages import CPP_ABORT, CPP_STAGE, StageAbort, StageItem, StageRequest
from mooncaked.roles.worker.kv.plan import KvPlan
from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.roles.worker.messages import PrefillRequest, TokenSample
from mooncaked.roles.worker.prefill.forward import PrefillCancelled
from mooncaked.roles.worker.group.stage_job import reads_history
from mooncaked.roles.worker.sampling import to_params
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import Internal, RpcError, Unavailable

logger = logging.getLogger(__name__)

ABORT_CALL_S = 2.0  # a CPP_ABORT call's own deadline: cleanup only (a stage that misses it ends by its deadline)


class PipelineHead:
    """The pipeline side of a first stage: owns the send slots; each prompt's run owns the rest."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.send_slots: HiddenSlots | None = None

    @property
    def stage(self) -> GroupStage:
        assert self.worker.stage is not None
        return self.worker.stage

    async def start(self) -> None:
        worker, loaded = self.worker, self.worker.loaded
        assert loaded is not None
        self.send_slots = HiddenSlots(worker.engine, f"{worker.instance.name}/cpp-send", NUM_HIDDEN_SLOTS,
                                      worker.section.cpp_chunk_tokens, loaded.args.hidden_size, loaded.dtype,
                                      pin=loaded.device.type == "cuda")

    async def stop(self) -> None:
        if self.send_slots is not None:
            self.send_slots.wake()
            self.send_slots.close()

    async def run(self, request: PrefillRequest, plan: KvPlan, deadline: float) -> tuple[TokenSample, float]:
        """The first token and this stage's compute seconds; Unavailable naming a failed stage."""
        assert self.send_slots is not None
        return await PipelineRun(self, request, plan, deadline).run()


class PipelineRun:
    """One prompt through the group. Owns the later stages' CPP_STAGE streams (one task each), the chunk sender
    and the run's failure."""

    def __init__(self, head: PipelineHead, request: PrefillRequest, plan: KvPlan, deadline: float) -> None:
        self.head = head
        self.worker = head.worker
        self.stage = head.stage
        self.request = request
        self.plan = plan
        self.deadline = deadline
        self.error: Exception | None = None
        self._is_error_secondary = False  # a chunk handoff failed: the stage's own stream may still say why
        self._stages: dict[str, asyncio.Task[StageItem]] = {}
        self._ready: dict[str, asyncio.Future[None]] = {}
        assert head.send_slots is not None
        client = self.worker.peers.for_instance(self.worker.member_instance(self.stage.next_member))
        self.sender = ChunkSender(self.worker, head.send_slots, client, request.request_id, deadline,
                                  lambda exc: self.fail(_stage_failed(self.stage, 1, exc), is_secondary=True),
                                  lambda: plan.is_cancelled)

    def fail(self, error: Exception, is_secondary: bool = False) -> None:
        """Any thread's view of the run ends here: nothing more is computed, sent or stored for it. The first
        error is the run's, except that a stage's own failure replaces a chunk handoff's (its consequence)."""
        if self.error is None or (self._is_error_secondary and not is_secondary):
            self.error, self._is_error_secondary = error, is_secondary
            logger.warning("%s: %s", self.request.request_id, error)
        self.plan.is_cancelled = True
        if self.head.send_slots is not None:
            self.head.send_slots.wake()

    async def run(self) -> tuple[TokenSample, float]:
        try:
            await self._open_stages()
            compute_s = await self._compute()
            await self.sender.wait_sent()
            items = await self._stage_items()
            self._raise_failure()
            first_token = items[-1].first_token
            if first_token is None:
                raise Internal(f"the last stage of {self.stage.group.name!r} sent no first token")
            return first_token, compute_s
        except BaseException as exc:
            self.fail(self.error or _as_failure(exc))
            await self._stop_stages()
            if not isinstance(exc, asyncio.CancelledError):
                self._raise_failure()
            raise

    def _raise_failure(self) -> None:
        if self.error is not None:
            raise self.error

    # ---- the later stages ----------------------------------------------------------------------------------
    def _stage_request(self, index: int) -> StageRequest:
        plan, request, layers = self.plan, self.request, self.stage.stage_layers[index]
        is_last = index == len(self.stage.stage_layers) - 1
        needs_history = reads_history(request.sampling, to_params(request.sampling, self.worker.vocab_size))
        return StageRequest(
            request.request_id, self.stage.group.name, index, layers.start, layers.end, plan.kv.num_tokens,
            plan.num_prefix_blocks, self.worker.section.cpp_chunk_tokens, request.sampling,
            sources=_nonempty(plan.sources), writes=_nonempty(plan.layer_writes()),
            token_ids=list(request.token_ids) if is_last and needs_history else [])

    async def _open_stages(self) -> None:
        """Every later stage answers ready, or the run fails (a stage failed, or the deadline passed)."""
        loop = asyncio.get_running_loop()
        for offset, member in enumerate(self.stage.downstream, start=1):
            self._ready[member] = loop.create_future()
            self._stages[member] = asyncio.create_task(self._follow(offset, member), name=f"cpp-{member}")
        waiting: list[asyncio.Future[Any]] = [*self._ready.values(), *self._stages.values()]
        while self.error is None and not all(f.done() for f in self._ready.values()):
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.fail(Unavailable(f"prefill group {self.stage.group.name!r}: its stages were not ready before "
                                      "the deadline"))
                break
            await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            waiting = [f for f in waiting if not f.done()]
        self._raise_failure()

    async def _follow(self, index: int, member: str) -> StageItem:
        """Stage `index`'s stream: its first item (ready), then its last (done); a failure fails the run."""
        timeout_s = max(self.deadline - time.monotonic(), 0.001)
        try:
            client = self.worker.peers.for_instance(self.worker.member_instance(member))
            async with contextlib.aclosing(client.stream(CPP_STAGE, self._stage_request(index),
                                                         timeout_s=timeout_s)) as items:
                first = await anext(items)
                if first.is_done:
                    raise Internal("answered done before it was sent any chunk")
                self._ready[member].set_result(None)
                done = await anext(items)
                if not done.is_done:
                    raise Internal("sent a second ready item")
                return done
        except (RpcError, StopAsyncIteration) as exc:
            self.fail(_stage_failed(self.stage, index, exc if isinstance(exc, RpcError) else
                                    Unavailable("its stream ended early")))
            assert self.error is not None
            raise self.error from None

    async def _stage_items(self) -> list[StageItem]:
        tasks = list(self._stages.values())
        await asyncio.wait(tasks, timeout=max(self.deadline - time.monotonic(), 0.001))
        if not all(task.done() for task in tasks):
            self.fail(Unavailable(f"prefill group {self.stage.group.name!r}: a stage did not finish before the "
                                  "deadline"))
        self._raise_failure()
        return [task.result() for task in tasks]

    async def _stop_stages(self) -> None:
        """Tell every stage still running to stop, and wait (within transfer.timeout_s) until each has settled."""
        running = [member for member, task in self._stages.items() if not task.done()]
        reason = str(self.error) if self.error is not None else "stopped"
        await asyncio.gather(*(self._abort(member, reason) for member in running))
        tasks = list(self._stages.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.worker.config.transfer.timeout_s)
            for task in late:  # cancelling closes its stream: the stage stops and settles on its own
                logger.error("%s: stage %s did not stop within transfer.timeout_s", self.request.request_id,
                             task.get_name())
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.sender.settle()

    async def _abort(self, member: str, reason: str) -> None:
        try:
            client = self.worker.peers.for_instance(self.worker.member_instance(member))
            await client.call(CPP_ABORT, StageAbort(self.request.request_id, reason[:500]), timeout_s=ABORT_CALL_S)
        except RpcError as exc:
            logger.info("%s: CPP_ABORT to %s failed (it stops at its deadline): %s", self.request.request_id,
                        member, exc)

    # ---- this stage's forward ------------------------------------------------------------------------------
    async def _compute(self) -> float:
        """This stage's chunks on the compute thread. Cancelled, it marks the plan cancelled and still waits for
        the thread to leave the prompt (at its next layer boundary)."""
        forward = asyncio.ensure_future(self.worker.compute(self._forward))
        try:
            compute_s = await asyncio.shield(forward)
        except asyncio.CancelledError:
            self.plan.is_cancelled = True
            await asyncio.wait([forward])
            raise
        except PrefillCancelled:
            self._raise_failure()
            raise
        return compute_s

    def _forward(self) -> float:
        """Compute thread: chunk j through this stage's layers, then handed to stage 2 while chunk j+1 runs. The
        forward's seconds (not the waits for a free send slot)."""
        plan = self.plan
        chunks = split_prefill_chunks(plan.prefill_seq(), self.worker.section.cpp_chunk_tokens)
        compute_s = 0.0
        for index, chunk in enumerate(chunks):
            started = time.monotonic()
            hidden = run_chunk(self.worker, plan, chunk, None, is_first_chunk=index == 0,
                               is_last_chunk=index == len(chunks) - 1)
            compute_s += time.monotonic() - started
            self.sender.send(index, hidden)
            if plan.is_cancelled:
                raise PrefillCancelled(f"{plan.kv.request_id} was stopped")
        return compute_s


def _nonempty(moves: list[StoreBlocks]) -> list[StoreBlocks]:
    return [m for m in moves if m.block_indices]


def _stage_failed(stage: GroupStage, index: int, exc: BaseException) -> Exception:
    member = stage.group.members[index]
    return Unavailable(f"prefill group {stage.group.name!r}: stage {index} ({member}) failed: {exc}")


def _as_failure(exc: BaseException) -> Exception:
    if isinstance(exc, asyncio.CancelledError):
        return Unavailable("the prefill was cancelled")
    return exc if isinstance(exc, Exception) else Unavailable(str(exc))
