"""The prefill role (docs/design.md section 3, step 3): reuse the cached prefix, compute the rest layer by layer,
stream KV out.

1. PREFILL arrives: check the block keys, fetch a remote prefix into this host's store when told to (this is
   also hot-block replication), allocate store space for the new blocks, read the cached prefix into staging.
2. The job joins the queue (roles/worker/prefill/queue.py); the batch loop takes as many queued jobs as fit
   `max_batch_tokens` (a prompt longer than `prefill_chunk` runs alone, in chunks), interactive before batch,
   then by priority and arrival (sched/priority.py), never a batch line in the forward of an interactive prompt,
   and runs one forward on the compute thread.
3. Layer by layer: before layer i, the prefix KV of layer i goes into pages; after layer i, layer i's new KV is
   copied to staging and written into this host's store and into the decode host's reserved blocks.
4. After the last layer: wait for every write, commit the new blocks (they become cache), sample the first
   token, reply. Whatever happens, `finally` aborts uncommitted handles, ends leases and frees pages.
5. Each batch's time, split per prompt by compute share, refits the instance's performance model (profiled at
   start); LOAD reports the model, the predicted work the instance holds and its per-request overhead.
6. The batch loop is supervised (runtime/supervised.py): an unexpected exception outside a batch's own error
   handling is logged, the queued prompts fail with Unavailable (the conductor places them again) and the
   worker is marked failed (the role stops, exits non-zero and is restarted).
A prefill group's member (cluster.prefill_groups) holds only its layers: the first stage takes PREFILL, runs its
queue one prompt at a time and drives each through the group's pipeline (roles/worker/group/head.py), reporting the
group's pipeline in LOAD (roles/worker/group/monitor.py); the later stages serve the pipeline's calls
(roles/worker/group/stage.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from mooncaked.cluster.membership import Membership
from mooncaked.config import Config, InstanceConfig
from mooncaked.roles.base import RoleEndpoint
from mooncaked.roles.worker.group.head import PipelineHead
from mooncaked.roles.worker.group.monitor import GroupMonitor
from mooncaked.roles.worker.group.stage import StageService
from mooncaked.roles.worker.kv.device_report import device_cache_report
from mooncaked.roles.worker.messages import LOAD, PREFILL, LoadReply, LoadRequest, PrefillReply, PrefillRequest
from mooncaked.roles.worker.messages import TokenSample
from mooncaked.roles.worker.prefill.forward import ForwardResult, PrefillCancelled, run_prefill_forward
from mooncaked.roles.worker.prefill.load import PrefillLoad
from mooncaked.roles.worker.prefill.page_line import PageLine, plan_in_line
from mooncaked.roles.worker.prefill.prompt_logprobs import wants_prompt_logprobs
from mooncaked.roles.worker.prefill.queue import PrefillJob
from mooncaked.roles.worker.profiler import profile
from mooncaked.roles.worker.sampling import history_of, to_params
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext, InvalidArgument, RpcError, Unavailable
from mooncaked.runtime.logs import request_id_var
from mooncaked.runtime.metrics import Metrics
from mooncaked.runtime.metrics_http import MetricsEndpoint
from mooncaked.runtime.supervised import start_supervised, stop_task
from mooncaked.sched.prefill_batch import take_batch

logger = logging.getLogger(__name__)


class PrefillRole:
    """Owns the worker, the prefill queue and the batch loop task; in a prefill group also its stage's pipeline
    part: the first stage's `pipeline` (roles/worker/group/head.py) or a later stage's `stage_service`
    (roles/worker/group/stage.py)."""

    name = "prefill"

    def __init__(self, config: Config, instance: InstanceConfig, membership: Membership | None = None,
                 worker: Worker | None = None) -> None:
        self.config = config
        self.instance = instance
        self.worker = worker or Worker(config, instance, membership)
        self.endpoint = RoleEndpoint(config, instance, extra_info=self._info,
                                     is_healthy=lambda: not self.worker.failed.is_set())
        self.endpoint.add_method(PREFILL, self._prefill)
        self.endpoint.add_method(LOAD, self._load, is_eager=True)
        self._queue: list[PrefillJob] = []
        self._running: list[PrefillJob] = []
        self.page_line: PageLine | None = None  # from activate(): prompts waiting for KV pages
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.load: PrefillLoad | None = None  # from start(): needs the model's hidden size
        self.metrics = Metrics()
        self.metrics_endpoint = MetricsEndpoint(instance.host, instance.metrics_port, self.metrics,
                                                self._refresh_metrics)
        self.pipeline: PipelineHead | None = None
        self.group_monitor: GroupMonitor | None = None
        self.stage_service: StageService | None = None

    @property
    def failed(self) -> asyncio.Event:
        """Set when the instance cannot serve any more (a tensor-parallel rank exited): serve() stops it and
        exits non-zero, so the supervisor restarts it."""
        return self.worker.failed

    async def start(self) -> None:
        await self.worker.start()
        await self._start_stage()
        await profile(self.worker, with_decode=False)
        self.activate()
        await self.endpoint.start()
        await self.metrics_endpoint.start()

    async def _start_stage(self) -> None:
        stage = self.worker.stage
        if stage is None:
            return
        if stage.is_first:
            self.pipeline = PipelineHead(self.worker)
            await self.pipeline.start()
            self.group_monitor = GroupMonitor(self.worker)
            self.group_monitor.start()
        else:
            self.stage_service = StageService(self.worker, self.endpoint)
            await self.stage_service.start()

    async def stop(self) -> None:
        await self.metrics_endpoint.stop()
        await self.endpoint.stop()
        await self.deactivate()
        if self.stage_service is not None:
            await self.stage_service.stop()
        if self.group_monitor is not None:
            await self.group_monitor.stop()
        if self.pipeline is not None:
            await self.pipeline.stop()
        await self.worker.stop()

    def activate(self) -> None:
        """Start taking prefills on the (started) worker; a switchable instance calls this when it becomes prefill."""
        if self.load is None:
            assert self.worker.loaded is not None
            self.load = PrefillLoad(self.worker.perf, self.worker.loaded.args.hidden_size)
        pages = self.worker.pages
        assert pages is not None
        self.page_line = PageLine(lambda: pages.num_free, pages.num_pages)
        self._loop_task = start_supervised("prefill-batch-loop", self._batch_loop, on_failure=self._loop_failed)

    async def deactivate(self) -> None:
        """Stop the batch loop and fail what is still queued (nothing, after a drain); the worker stays."""
        task, self._loop_task = self._loop_task, None
        await stop_task(task)
        self._fail_queued(f"{self.instance.name} stopped taking prefills")
        if self.page_line is not None:
            self.page_line.close(f"{self.instance.name} stopped taking prefills")

    def _loop_failed(self, reason: str) -> None:
        self.worker.fail(reason)
        self._fail_queued(f"{self.instance.name} failed ({reason}); place the prompt elsewhere")

    def _fail_queued(self, why: str) -> None:
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(Unavailable(why))

    @property
    def is_idle(self) -> bool:
        is_stage_idle = self.stage_service is None or self.stage_service.is_idle
        return not self._queue and not self._running and not self.page_line and is_stage_idle

    def _refresh_metrics(self) -> None:
        self.metrics.queues.set_length("prefill", len(self._queue) + len(self.page_line or ()))

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

    def _info(self) -> dict[str, str]:
        return {"queued": str(len(self._queue)), "running": str(len(self._running))}

    async def _load(self, request: LoadRequest, ctx: CallContext) -> LoadReply:
        pages, load, now = self.worker.pages, self.load, time.monotonic()
        assert pages is not None and load is not None
        load.pipeline = self.group_monitor.spec() if self.group_monitor is not None else None
        spec = load.pipeline_now(now)
        coefficients = load.coefficients(now)
        num_running = len(self._running) + (len(self.stage_service.jobs) if self.stage_service else 0)
        is_member = self.worker.stage is not None  # its model covers its layers only: not a whole-model predictor
        own = list(coefficients.prefill)
        waiting = self.page_line.waiting if self.page_line is not None else []
        queued = [job.prompt for job in self._queue] + [(waiter.num_tokens, 0) for waiter in waiting]
        return LoadReply(role="prefill", num_running=num_running, num_waiting=len(queued),
                         num_queued_tokens=sum(job.num_new_tokens for job in self._queue + self._running)
                         + sum(waiter.num_tokens for waiter in waiting),
                         num_free_pages=pages.num_free, num_pages=pages.num_pages,
                         step_time_s=load.mean_batch_s, prefill_coefficients=[] if is_member else own,
                         decode_coefficients=list(coefficients.decode),
                         pending_work_s=load.pending_work_s(queued, now),
                         held_request_ids=[job.request.request_id for job in self._running + self._queue]
                         + [waiter.request_id for waiter in waiting],
                         overhead_s=load.overhead.value, kv_cache_bytes=self.worker.kv_cache_bytes,
                         stage_coefficients=own if is_member else [],
                         chunk_handoff_s=self.stage_service.handoff.value if self.stage_service else 0.0,
                         pipeline_stages=[list(c) for c in spec.stage_coefficients] if spec else [],
                         pipeline_handoffs_s=list(spec.handoff_s) if spec else [],
                         cpp_chunk_tokens=spec.chunk_tokens if spec else 0,
                         **device_cache_report(self.worker, request.device_cache_seq))

    async def _prefill(self, request: PrefillRequest, ctx: CallContext) -> PrefillReply:
        request_id_var.set(request.request_id)
        arrived_at = time.monotonic()
        stage = self.worker.stage
        if stage is not None and not stage.is_first:
            raise InvalidArgument(f"{self.instance.name} is {stage.describe()}; send PREFILL to its first stage "
                                  f"{stage.group.members[0]}")
        params = to_params(request.sampling, self.worker.vocab_size)  # invalid ones fail here, not inside a batch
        history_of(request.token_ids, params, request.sampling.num_sampled)
        assert self.worker.grammar is not None
        grammars = [self.worker.grammar.state_for(request.sampling, request.token_ids)
                    for _ in range(request.sampling.num_sequences)]
        if (request.sampling.num_prompt_logprobs is not None or request.sampling.num_sequences > 1) and stage:
            raise InvalidArgument(f"prompt logprobs and parallel sampling are not served by prefill groups "
                                  f"({stage.describe()}); send the prompt to a single prefill instance")
        page_line = self.page_line
        if page_line is None:
            raise Unavailable(f"{self.instance.name} is not taking prefills; place the prompt elsewhere")
        plan = await plan_in_line(page_line, self.worker, request, ctx.deadline)
        job = PrefillJob(request, plan, arrived_at, time.monotonic(), asyncio.get_running_loop().create_future(),
                         deadline=ctx.deadline, grammars=grammars)
        job.idle.set()
        try:
            self._queue.append(job)
            self._wakeup.set()
            return await job.future
        finally:
            if not job.future.done() or job.future.cancelled():  # cancelling this call cancels job.future
                plan.is_cancelled = True  # the forward sends nothing more for it
            if job in self._queue:
                self._queue.remove(job)
            await job.idle.wait()  # pages stay allocated until the compute thread has left this job
            await plan.close(commit=job.future.done() and not job.future.cancelled()
                             and job.future.exception() is None)
            page_line.freed()

    def _take_batch(self) -> list[PrefillJob]:
        section = self.worker.section
        is_every_row = wants_prompt_logprobs([job.request.sampling for job in self._queue])  # their logits alone
        return take_batch(self._queue, section.max_batch_tokens, section.prefill_chunk,
                          is_one_at_a_time=self.pipeline is not None or is_every_row)

    async def _batch_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = self._take_batch()
                await self._run_batch(batch)

    async def _run_batch(self, batch: list[PrefillJob]) -> None:
        started = time.monotonic()
        for job in batch:
            job.is_running, job.started_at = True, started
            job.idle.clear()
        self._running = batch
        assert self.load is not None
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
            self._running = []
            for job in batch:
                job.is_running = False
                job.idle.set()

    async def _finish(self, batch: list[PrefillJob], result: ForwardResult, elapsed_s: float) -> None:
        assert self.load is not None
        for job, sample, prompt_logprobs, more in zip(batch, result.first_tokens, result.prompt_logprobs,
                                                      result.more_first_tokens):
            if job.future.done():
                continue
            try:
                await job.plan.kv.wait_writes(self.config.transfer.timeout_s)
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

