"""One prefill batch, from the batch loop's pick (role.py) to its replies: stages 3 to 5 of the prefill role.

1. `run(batch)`: the jobs become `running` (each job's `idle` is cleared: its pages and staging are the compute
   thread's until it is set again) and the load learns the batch's predicted seconds (load.py).
2. The forward on the compute thread (forward.py: layer by layer, prefix KV into pages before each layer, new KV
   to this host's store and the decode host's blocks after it); a prefill group's first stage drives its one
   prompt through the group's pipeline instead (roles/worker/group/head.py). Cancelled (the role is stopping),
   every plan is marked cancelled and the run still waits for the thread to leave the batch at its next layer
   boundary.
3. The batch's time goes to the metrics (step, queue wait, prefix reuse, bytes moved) and to the load, which
   splits it per prompt by compute share (a batch that fetched a prefix from another host is no sample).
4. Each job waits for its layer writes, then its PREFILL call gets the reply (first token, timings); a failure
   fails every job not answered yet. The call itself then commits or aborts the plan, once `idle` is set.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mooncaked.roles.worker.group.head import PipelineHead
from mooncaked.roles.worker.messages import PrefillReply
from mooncaked.roles.worker.prefill.forward import ForwardResult, PrefillCancelled, run_prefill_forward
from mooncaked.roles.worker.prefill.load import PrefillLoad
from mooncaked.roles.worker.prefill.queue import PrefillJob
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import RpcError
from mooncaked.runtime.metrics import Metrics

logger = logging.getLogger(__name__)


class BatchRunner:
    """Owns the batch on the compute thread now (`running`); the worker, the load, the metrics and a group's
    pipeline are the PrefillRole's."""

    def __init__(self, worker: Worker, load: PrefillLoad, metrics: Metrics, pipeline: PipelineHead | None,
                 transfer_timeout_s: float) -> None:
        self.worker = worker
        self.load = load
        self.metrics = metrics
        self.pipeline = pipeline
        self.transfer_timeout_s = transfer_timeout_s
        self.running: list[PrefillJob] = []

    async def run(self, batch: list[PrefillJob]) -> None:
        started = time.monotonic()
        for job in batch:
            job.is_running, job.started_at = True, started
            job.idle.clear()
        self.running = batch
        self.load.batch_started([job.prompt for job in batch], started)
        try:
            result, stage_s = await self._compute(batch)
            elapsed_s = time.monotonic() - started
            self._observe(batch, started, elapsed_s)
            self.load.batch_finished([job.prompt for job in batch], elapsed_s if stage_s is None else stage_s,
                                     is_sample=not any(job.plan.num_fetched_blocks for job in batch))
            await self._finish(batch, result, elapsed_s)
        except Exception as exc:
            if isinstance(exc, RpcError):  # a prefill group's stage failed: the error names it
                logger.warning("prefill batch of %d failed: %s", len(batch), exc)
            elif not isinstance(exc, PrefillCancelled):
                logger.exception("prefill batch of %d failed", len(batch))
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
        finally:
            self.running = []
            for job in batch:
                job.is_running = False
                job.idle.set()

    async def _compute(self, batch: list[PrefillJob]) -> tuple[ForwardResult, float | None]:
        """The forward on the compute thread (a group's first stage: through the pipeline, with the seconds of
        this stage's part of it; None elsewhere: the batch's whole time is its sample). Cancelled (the role is
        stopping), it marks every plan cancelled and still waits for the thread to leave the batch (at its next
        layer boundary): until then the batch's pages and staging are in use."""
        if self.pipeline is not None:
            job = batch[0]
            first_token, compute_s = await self.pipeline.run(job.request, job.plan, job.deadline)
            return ForwardResult([first_token], [[]], [[]]), compute_s
        forward = asyncio.ensure_future(self.worker.compute(self._forward, batch))
        try:
            return await asyncio.shield(forward), None
        except asyncio.CancelledError:
            for job in batch:
                job.plan.is_cancelled = True
            await asyncio.wait([forward])
            raise

    def _forward(self, batch: list[PrefillJob]) -> ForwardResult:
        return run_prefill_forward(self.worker, [job.plan for job in batch], [job.request.sampling for job in batch],
                                   [job.grammars for job in batch])

    def _observe(self, batch: list[PrefillJob], started: float, elapsed_s: float) -> None:
        worker = self.worker
        self.metrics.engine.observe_step("prefill", num_requests=len(batch),
                                         num_tokens=sum(job.num_new_tokens for job in batch), step_s=elapsed_s)
        for job in batch:
            plan = job.plan
            self.metrics.queues.observe_wait("prefill", started - job.enqueued_at)
            num_remote = min(plan.num_fetched_blocks, plan.num_prefix_blocks)
            self.metrics.cache.observe_prefix(num_local=plan.num_prefix_blocks - num_remote, num_remote=num_remote,
                                              num_computed=plan.kv.num_full_blocks - plan.num_prefix_blocks)
            self.metrics.cache.observe_device_prefix(num_blocks=plan.num_device_blocks,
                                                     num_cached=worker.pages.num_cached if worker.pages else 0)
            num_sent = sum(len(wanted) for wanted in plan.destinations.values())
            self.metrics.cache.observe_transfer("write", num_sent * worker.block_nbytes)
            self.metrics.cache.observe_transfer("read", plan.num_fetched_blocks * worker.block_nbytes)

    async def _finish(self, batch: list[PrefillJob], result: ForwardResult, elapsed_s: float) -> None:
        for job, sample, prompt_logprobs, more in zip(batch, result.first_tokens, result.prompt_logprobs,
                                                      result.more_first_tokens):
            if job.future.done():
                continue
            try:
                await job.plan.kv.wait_writes(self.transfer_timeout_s)
            except Exception as exc:
                job.future.set_exception(exc)
                continue
            now = time.monotonic()
            self.load.replied(now - job.arrived_at, job.started_at - job.enqueued_at, elapsed_s)
            loader = job.plan.kv.loader
            fetch_s = loader.load_s if job.plan.num_fetched_blocks and loader is not None else 0.0
            job.future.set_result(PrefillReply(
                first_token=sample, num_cached_tokens=job.num_prefix_tokens,
                num_fetched_blocks=job.plan.num_fetched_blocks, prefill_s=now - job.enqueued_at, compute_s=elapsed_s,
                fetch_s=fetch_s, prompt_logprobs=prompt_logprobs, more_first_tokens=more))
