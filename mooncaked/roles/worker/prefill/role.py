"""The prefill role (docs/design.md section 3, step 3): reuse the cached prefix, compute the rest layer by layer,
stream KV out.

1. PREFILL arrives: check the block keys, fetch a remote prefix into this host's store when told to (this is
   also hot-block replication), allocate store space for the new blocks, read the cached prefix into staging.
2. The job joins the queue (roles/worker/prefill/queue.py); the batch loop takes as many queued jobs as fit
   `max_batch_tokens` (a prompt longer than `prefill_chunk` runs alone, in chunks), interactive before batch,
   then by priority and arrival (sched/priority.py), never a batch line in the forward of an interactive prompt,
   and hands it to the batch runner (roles/worker/prefill/batch.py), which runs one forward on the compute thread.
3. Layer by layer (batch.py, forward.py): before layer i, the prefix KV of layer i goes into pages; after layer i,
   layer i's new KV is copied to staging and written into this host's store and into the decode host's reserved
   blocks.
4. After the last layer (batch.py): sample the first token, wait for every write, reply. The PREFILL call (here)
   then commits the new blocks (they become cache); whatever happens, its `finally` aborts uncommitted handles,
   ends leases and frees pages.
5. Each batch's time, split per prompt by compute share, refits the instance's performance model (profiled at
   start; batch.py feeds it); LOAD reports the model, the predicted work the instance holds and its per-request
   overhead.
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
import time

from mooncaked.cluster.membership import Membership
from mooncaked.config import Config, InstanceConfig
from mooncaked.roles.base import RoleEndpoint
from mooncaked.roles.worker.group.head import PipelineHead
from mooncaked.roles.worker.group.monitor import GroupMonitor
from mooncaked.roles.worker.group.stage import StageService
from mooncaked.roles.worker.kv.device_report import device_cache_report
from mooncaked.roles.worker.messages import LOAD, PREFILL, LoadReply, LoadRequest, PrefillReply, PrefillRequest
from mooncaked.roles.worker.prefill.batch import BatchRunner
from mooncaked.roles.worker.prefill.load import PrefillLoad
from mooncaked.roles.worker.prefill.page_line import PageLine, plan_in_line
from mooncaked.roles.worker.prefill.prompt_logprobs import wants_prompt_logprobs
from mooncaked.roles.worker.prefill.queue import PrefillJob
from mooncaked.roles.worker.profiler import profile
from mooncaked.roles.worker.sampling import history_of, to_params
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import CallContext, InvalidArgument, Unavailable
from mooncaked.runtime.logs import request_id_var
from mooncaked.runtime.metrics import Metrics
from mooncaked.runtime.metrics_http import MetricsEndpoint
from mooncaked.runtime.supervised import start_supervised, stop_task
from mooncaked.sched.prefill_batch import take_batch


class PrefillRole:
    """Owns the worker, the prefill queue, the batch loop task and the batch runner (batch.py: the running batch);
    in a prefill group also its stage's pipeline part: the first stage's `pipeline` (roles/worker/group/head.py) or
    a later stage's `stage_service` (roles/worker/group/stage.py)."""

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
        self.page_line: PageLine | None = None  # from activate(): prompts waiting for KV pages
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.load: PrefillLoad | None = None  # from activate(): needs the model's hidden size
        self.batch_runner: BatchRunner | None = None  # from activate(), with the load
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
            self.batch_runner = BatchRunner(self.worker, self.load, self.metrics, self.pipeline,
                                            self.config.transfer.timeout_s)
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
    def running(self) -> list[PrefillJob]:
        """The batch on the compute thread now (the batch runner's)."""
        return self.batch_runner.running if self.batch_runner is not None else []

    @property
    def is_idle(self) -> bool:
        is_stage_idle = self.stage_service is None or self.stage_service.is_idle
        return not self._queue and not self.running and not self.page_line and is_stage_idle

    def _refresh_metrics(self) -> None:
        self.metrics.queues.set_length("prefill", len(self._queue) + len(self.page_line or ()))

    def _info(self) -> dict[str, str]:
        return {"queued": str(len(self._queue)), "running": str(len(self.running))}

    async def _load(self, request: LoadRequest, ctx: CallContext) -> LoadReply:
        pages, load, now = self.worker.pages, self.load, time.monotonic()
        assert pages is not None and load is not None
        load.pipeline = self.group_monitor.spec() if self.group_monitor is not None else None
        spec = load.pipeline_now(now)
        coefficients = load.coefficients(now)
        num_running = len(self.running) + (len(self.stage_service.jobs) if self.stage_service else 0)
        is_member = self.worker.stage is not None  # its model covers its layers only: not a whole-model predictor
        own = list(coefficients.prefill)
        waiting = self.page_line.waiting if self.page_line is not None else []
        queued = [job.prompt for job in self._queue] + [(waiter.num_tokens, 0) for waiter in waiting]
        return LoadReply(role="prefill", num_running=num_running, num_waiting=len(queued),
                         num_queued_tokens=sum(job.num_new_tokens for job in self._queue + self.running)
                         + sum(waiter.num_tokens for waiter in waiting),
                         num_free_pages=pages.num_free, num_pages=pages.num_pages,
                         step_time_s=load.mean_batch_s, prefill_coefficients=[] if is_member else own,
                         decode_coefficients=list(coefficients.decode),
                         pending_work_s=load.pending_work_s(queued, now),
                         held_request_ids=[job.request.request_id for job in self.running + self._queue]
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
        runner = self.batch_runner
        assert runner is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await runner.run(self._take_batch())
