"""A tensor-parallel model runner: this process is rank 0 and drives N-1 spawned rank processes.

Lifecycle:
1. `TensorParallelRunner.start(spec, num_ranks)` refuses a degree the model's heads do not allow (before any
   process starts), opens the rendezvous store on a free loopback port, spawns ranks 1..N-1 (engine.tp_rank),
   joins the process group as rank 0 (on CPU also creating the shared all-reduce segment, engine.tp_shm, and
   passing it to the ranks), loads its own shard, and waits (with the spec's deadline, watching the
   children) until every rank reports ready; any failure stops every rank and raises.
2. `prefill(batch)` / `decode(batch)` send the batch to every rank, then run rank 0's forward: each rank
   computes its heads and MLP columns on its own KV pages, the all-reduces inside the layers join them, and
   rank 0 returns the logits (the output head is replicated). Layer callbacks are not supported.
3. A rank that dies or stalls makes the step fail with RankFailed within the deadline (its channel breaks or
   the collective times out); the group is then down: every later step raises, and the owner stops the runner
   (a worker instance goes down whole; its supervisor restarts it).
4. `stop()` asks every rank to stop, waits for them with the deadline, kills any left, leaves the group.
Only one runner per process: the group is process-wide (model.tensor_parallel).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from mooncaked.engine.batch import DecodeBatch, PrefillBatch
from mooncaked.engine.tp_channel import ChannelClosed, RankChannel
from mooncaked.engine.tp_rank import (LOOPBACK, BackendReducer, RankShard, RankSpec, batch_to_wire, build_rank,
                                      check_devices, join_group, rank_main, uses_shared_memory)
from mooncaked.engine.tp_shm import SharedMemoryReducer
from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.loader import model_args
from mooncaked.model import tensor_parallel
from mooncaked.model.tensor_parallel import check_shardable

logger = logging.getLogger(__name__)


class RankFailed(RuntimeError):
    """A tensor-parallel rank died, stalled or failed; the message names it. The group is unusable after."""


class TensorParallelRunner:
    """Owns the rank processes, their channels, this process's process-group membership and rank 0's shard."""

    def __init__(self, spec: RankSpec, num_ranks: int) -> None:
        self.spec = spec
        self.num_ranks = num_ranks
        self.processes: list[BaseProcess] = []  # rank r + 1's process
        self.channels: list[RankChannel] = []  # rank r + 1's channel
        self.shard: RankShard | None = None
        self.reducer: SharedMemoryReducer | None = None
        self.failure: str | None = None

    @classmethod
    def start(cls, spec: RankSpec, num_ranks: int) -> TensorParallelRunner:
        check_shardable(model_args(spec.source), num_ranks)
        check_devices(spec, num_ranks)
        if tensor_parallel.has_group():
            raise RuntimeError("this process already belongs to a tensor-parallel group; stop its runner first")
        store = dist.TCPStore(LOOPBACK, 0, num_ranks, is_master=True, timeout=timedelta(seconds=spec.timeout_s),
                              wait_for_workers=False)
        runner = cls(spec, num_ranks)
        try:
            runner._spawn(store.port)
            tensor_parallel.install_group(runner._join_reducer(store))
            runner.shard = build_rank(spec, 0, num_ranks)
            runner._wait_ready(time.monotonic() + spec.timeout_s)
        except BaseException:
            runner.stop()
            raise
        return runner

    def _join_reducer(self, store: dist.Store) -> tensor_parallel.Reducer:
        """Rank 0's reducer; with shared memory, create the segment and pass it to every rank."""
        backend = join_group(self.spec, 0, self.num_ranks, store)
        if not uses_shared_memory(self.spec):
            return BackendReducer(backend, self.num_ranks)
        self.reducer = SharedMemoryReducer.create(self.num_ranks, self.spec.allreduce_slot_bytes,
                                                  self.spec.timeout_s, backend, lambda: bool(self.dead_ranks()))
        for channel in self.channels:
            channel.send_fds(self.reducer.fds)
        return self.reducer

    def _spawn(self, port: int) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or CUDA state
        for rank in range(1, self.num_ranks):
            channel, theirs = RankChannel.pair(self.spec.timeout_s)
            self.channels.append(channel)
            process = context.Process(target=rank_main, args=(self.spec, rank, self.num_ranks, port, theirs),
                                      name=f"tp-rank-{rank}", daemon=True)
            process.start()
            theirs.close()
            self.processes.append(process)

    @property
    def model(self) -> LlamaForCausalLM:
        """Rank 0's shard of the model."""
        assert self.shard is not None
        return self.shard.loaded.model

    def prefill(self, batch: PrefillBatch, *, return_all_logits: bool = False) -> torch.Tensor:
        """Logits fp32 [S, vocab] (last new token per sequence), or [T, vocab] with return_all_logits."""
        assert self.shard is not None
        runner = self.shard.runner
        return self._step(("prefill", batch_to_wire(batch), return_all_logits),
                          lambda: runner.prefill(batch, return_all_logits=return_all_logits))

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits fp32 [S, vocab]."""
        assert self.shard is not None
        runner = self.shard.runner
        return self._step(("decode", batch_to_wire(batch)), lambda: runner.decode(batch))

    def dead_ranks(self) -> list[str]:
        """'rank r (exit code c)' for each rank process that has exited."""
        return [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.processes) if not p.is_alive()]

    def stop(self) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        for channel, process in zip(self.channels, self.processes):
            if process.is_alive():
                try:
                    channel.send(("stop",))
                except ChannelClosed:
                    pass
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("tensor-parallel %s did not stop in time; killing it", process.name)
                process.kill()
                process.join(self.spec.timeout_s)
        for channel in self.channels:
            channel.close()
        tensor_parallel.remove_group()
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None

    def _step(self, command: tuple[Any, ...], forward: Any) -> torch.Tensor:
        if self.failure is not None:
            raise RankFailed(f"the tensor-parallel group is down ({self.failure}); restart the instance")
        try:
            if self.dead_ranks():
                raise ChannelClosed("a rank process exited")
            for channel in self.channels:
                channel.send(command)
            logits: torch.Tensor = forward()
            return logits
        except Exception as exc:  # a broken channel, or the collective failed or timed out
            self.failure = self._describe_failure(exc)
            raise RankFailed(f"tensor-parallel step failed: {self.failure}") from exc

    def _describe_failure(self, exc: Exception) -> str:
        for process in self.processes:  # a rank that died is usually why; give its exit a moment to show
            process.join(0.5)
        reports = [message for channel in self.channels for message in _pending_errors(channel)]
        dead = self.dead_ranks()
        return "; ".join(reports + dead) or f"{type(exc).__name__}: {exc}"

    def _wait_ready(self, deadline: float) -> None:
        for rank, (channel, process) in enumerate(zip(self.channels, self.processes), start=1):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not channel.wait_readable(remaining, process.sentinel):
                process.join(0.5)
                raise RankFailed(f"tensor-parallel rank {rank} did not start within {self.spec.timeout_s:g} s "
                                 f"(exit code {process.exitcode})")
            message = channel.recv()
            if message[0] != "ready":
                raise RankFailed(f"tensor-parallel {message[1] if message[0] == 'error' else message}")


def _pending_errors(channel: RankChannel) -> list[str]:
    """Error reports a failed rank left on its channel."""
    errors = []
    try:
        while channel.wait_readable(0.0):
            message = channel.recv()
            if message[0] == "error":
                errors.append(str(message[1]))
    except ChannelClosed:
        pass
    return errors
