"""A prefill group's pipeline as its first stage knows it: every stage's fitted model and chunk handoff.

1. `GroupMonitor(worker)`; `start()` starts a task that asks every later stage for its LOAD every
   `worker.cpp_poll_interval_s` (each call within that interval) and keeps the stage's own model
   (`stage_coefficients`) and its mean chunk handoff; a member that does not answer keeps its last values
   (conductors judge the members' liveness by their own polls).
2. `spec()`: the group's PipelineSpec (sched/pipeline.py) from this stage's own model and the others' (a stage
   yet to report one is assumed to run like this one, per layer), or None until this stage has a fitted model
   (conductors then split their default model over the stages). The first stage predicts its queue with it and reports
   it in LOAD, so conductors predict the group's prefill time as a pipeline (fill, steady state, drain).
3. The task is supervised (runtime/supervised.py: an unexpected exception is logged and the task restarts);
   `stop()` cancels it and awaits it.
"""

from __future__ import annotations

import asyncio
import logging

from mooncaked.roles.worker.messages import LOAD, LoadRequest
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import RpcError
from mooncaked.runtime.supervised import start_supervised, stop_task
from mooncaked.sched.pipeline import split_predictor
from mooncaked.sched.predictors import PrefillTimePredictor
from mooncaked.sched.types import PipelineSpec

logger = logging.getLogger(__name__)


class GroupMonitor:
    """Owns the later stages' last reported models and handoffs, and the task that polls them."""

    def __init__(self, worker: Worker) -> None:
        assert worker.stage is not None and worker.stage.is_first
        self.worker = worker
        self.members = worker.stage.downstream
        self._coefficients: dict[str, tuple[float, ...]] = {}
        self._handoff_s: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = start_supervised("cpp-group-monitor", self._run)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    def spec(self) -> PipelineSpec | None:
        """A stage that has not reported a fitted model yet is assumed to run like this one, per layer."""
        own = self.worker.perf.coefficients().prefill
        stage = self.worker.stage
        if len(own) != 6 or stage is None:
            return None
        own_layers = stage.layers.size
        stages: list[tuple[float, ...]] = [own]
        for member, layers in zip(self.members, stage.stage_layers[1:]):
            guess = split_predictor(PrefillTimePredictor(own), [layers.size / own_layers])[0]
            stages.append(self._coefficients.get(member, guess))
        handoffs = tuple(self._handoff_s.get(member, 0.0) for member in self.members)
        return PipelineSpec(tuple(stages), self.worker.section.cpp_chunk_tokens, handoffs)

    async def _run(self) -> None:
        interval_s = self.worker.section.cpp_poll_interval_s
        while True:
            await asyncio.gather(*(self._poll(member, interval_s) for member in self.members))
            await asyncio.sleep(interval_s)

    async def _poll(self, member: str, timeout_s: float) -> None:
        try:
            client = self.worker.peers.for_instance(self.worker.member_instance(member))
            reply = await client.call(LOAD, LoadRequest(), timeout_s=timeout_s)
        except RpcError as exc:
            logger.debug("group member %s did not report its model: %s", member, exc)
            return
        if len(reply.stage_coefficients) == 6:
            self._coefficients[member] = tuple(reply.stage_coefficients)
        self._handoff_s[member] = reply.chunk_handoff_s
