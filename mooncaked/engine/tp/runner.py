"""A tensor-parallel model runner: this process is rank 0 and drives N-1 spawned rank processes.

Lifecycle:
1. `TensorParallelRunner.start(spec, num_ranks)` refuses a degree the model's heads do not allow (before any
   process starts), opens the rendezvous store on a free loopback port, spawns ranks 1..N-1 (engine.tp.rank),
   joins the process group as rank 0 (on CPU also creating the shared all-reduce segment, engine.tp.shm, and
   passing it to the ranks), loads its own shard, and waits (with the spec's deadline, watching the
   children) until every rank reports ready; any failure stops every rank and raises.
2. `prefill(batch)` / `decode(batch)` send the batch to every rank, then run rank 0's forward: each rank
   computes its heads and MLP columns on its own KV pages, the all-reduces inside the layers join them, and
   rank 0 returns the logits (the output head is replicated). A prefill's layer callbacks run on rank 0 and
   gate the other ranks (engine.tp.rank stage 5): a callback that raises stops the forward on every rank at
   that layer boundary and propagates, leaving the group usable. With `spec.is_pages_shared` every rank's pages
   are mapped here too (`rank_pages`: memfds on CPU, CUDA IPC on GPUs; engine/tp_pages.py), so rank 0 moves
   all the KV.
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
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import LayerCallback
from mooncaked.engine.tp.channel import ChannelClosed, RankChannel
from mooncaked.engine.tp.pages import SharedPages, import_device_pages
from mooncaked.engine.tp.rank import (LOOPBACK, BackendReducer, RankShard, RankSpec, batch_to_wire, build_rank,
                                      check_devices, is_cuda, join_group, pages_nbytes, rank_main,
                                      uses_shared_memory)
from mooncaked.engine.tp.shm import SharedMemoryReducer
from mooncaked.model import tensor_parallel
from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.loader import model_args
from mooncaked.model.tensor_parallel import check_shardable, shard_shape

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
        self.shared_pages: list[SharedPages] = []  # rank r + 1's pages, mapped here (spec.is_pages_shared)
        self.rank_pages: list[KVPages] = []  # every rank's pages, rank 0's first (spec.is_pages_shared)

    @classmethod
    def start(cls, spec: RankSpec, num_ranks: int) -> TensorParallelRunner:
        check_shardable(model_args(spec.source), num_ranks, spec.is_expert_parallel)
        check_devices(spec, num_ranks)
        if tensor_parallel.has_group():
            raise RuntimeError("this process already belongs to a tensor-parallel group; stop its runner first")
        store = dist.TCPStore(LOOPBACK, 0, num_ranks, is_master=True, timeout=timedelta(seconds=spec.timeout_s),
                              wait_for_workers=False)
        runner = cls(spec, num_ranks)
        try:
            runner._spawn(store.port)
            tensor_parallel.install_group(runner._join_reducer(store))
            if spec.is_pages_shared and not is_cuda(spec):
                runner._share_pages()
            runner.shard = build_rank(spec, 0, num_ranks)
            exported = runner._wait_ready(time.monotonic() + spec.timeout_s)
            if spec.is_pages_shared:
                runner.rank_pages = [runner.shard.kv_pages, *runner._mapped_rank_pages(exported)]
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

    def _share_pages(self) -> None:
        """Create every other rank's pages here and pass each its fd (after the all-reduce segment's)."""
        for rank, channel in enumerate(self.channels, start=1):
            pages = SharedPages.create(pages_nbytes(self.spec, rank, self.num_ranks), f"kv-pages-rank{rank}")
            self.shared_pages.append(pages)
            channel.send_fds([pages.fd])
            pages.forget_fd()

    def _mapped_rank_pages(self, exported: list[Any]) -> list[KVPages]:
        """Ranks 1..N-1's pages: in the memfds created here (CPU), or opened from their CUDA IPC handles."""
        assert self.shard is not None
        args, dtype = self.shard.loaded.args, self.shard.loaded.dtype
        buffers = ([import_device_pages(handle) for handle in exported] if is_cuda(self.spec)
                   else [pages.tensor for pages in self.shared_pages])
        return [KVPages.for_model(args, num_pages=self.spec.num_pages, block_size=self.spec.block_size, dtype=dtype,
                                  device=buffer.device, layers=self.spec.layers,
                                  shard=shard_shape(args, rank, self.num_ranks, self.spec.is_expert_parallel),
                                  buffer=buffer, cache_dtype=self.spec.cache_dtype)
                for rank, buffer in enumerate(buffers, start=1)]

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

    @property
    def kv_pages(self) -> KVPages:
        """Rank 0's pages."""
        assert self.shard is not None
        return self.shard.kv_pages

    def prefill(self, batch: PrefillBatch, *, before_layer: LayerCallback | None = None,
                after_layer: LayerCallback | None = None, return_all_logits: bool = False,
                hidden_in: torch.Tensor | None = None, return_hidden: bool = False) -> torch.Tensor:
        """Logits fp32 [S, vocab] (last new token per sequence), or [T, vocab] with return_all_logits; on a
        pipeline stage (spec.layers) `hidden_in` [T, hidden] replaces the embedding and `return_hidden` returns
        hidden [T, hidden] after the stage's layers (every rank holds all of it after the last all-reduce; the
        ranks get `hidden_in` with the batch). The callbacks run on rank 0 and gate the other ranks (stage 2)."""
        assert self.shard is not None
        runner = self.shard.runner
        is_gated = before_layer is not None or after_layer is not None
        raised: list[BaseException] = []
        gated_before, gated_after = self._gates(before_layer, after_layer, raised)
        hidden_wire = None if hidden_in is None else hidden_in.cpu()
        return self._step(("prefill", batch_to_wire(batch), return_all_logits, is_gated, hidden_wire, return_hidden),
                          lambda: runner.prefill(batch, return_all_logits=return_all_logits, hidden_in=hidden_in,
                                                 return_hidden=return_hidden,
                                                 before_layer=gated_before if is_gated else None,
                                                 after_layer=gated_after if is_gated else None), raised)

    def decode(self, batch: DecodeBatch, *, return_hidden: bool = False) -> torch.Tensor:
        """Logits fp32 [S, vocab]."""
        assert self.shard is not None
        if return_hidden:
            raise ValueError("a tensor-parallel decode returns logits")
        runner = self.shard.runner
        return self._step(("decode", batch_to_wire(batch)), lambda: runner.decode(batch), [])

    def _gates(self, before_layer: LayerCallback | None, after_layer: LayerCallback | None,
               raised: list[BaseException]) -> tuple[LayerCallback, LayerCallback]:
        """Rank 0's callbacks: run the caller's, then let the other ranks pass the boundary (go), or stop them
        there (abort) and re-raise, noting the exception in `raised` (the group stays usable)."""
        last_layer = self.kv_pages.num_layers - 1

        def run(callback: LayerCallback | None, layer: int) -> None:
            try:
                if callback is not None:
                    callback(layer)
            except BaseException as exc:
                raised.append(exc)
                self._send_all(("abort",))
                raise

        def before(layer: int) -> None:
            run(before_layer, layer)
            self._send_all(("go",))

        def after(layer: int) -> None:
            run(after_layer, layer)
            if layer == last_layer:
                self._send_all(("go",))

        return before, after

    def _send_all(self, message: tuple[Any, ...]) -> None:
        for channel in self.channels:
            channel.send(message)

    def dead_ranks(self) -> list[str]:
        """'rank r (exit code c)' for each rank process that has exited."""
        return [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.processes) if not p.is_alive()]

    def stop(self) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        self.rank_pages = []  # the worker's ShardedPages may still hold them; nothing copies after stop
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
        for pages in self.shared_pages:
            pages.close()
        self.shared_pages = []

    def _step(self, command: tuple[Any, ...], forward: Any, raised: list[BaseException]) -> torch.Tensor:
        if self.failure is not None:
            raise RankFailed(f"the tensor-parallel group is down ({self.failure}); restart the instance")
        try:
            if self.dead_ranks():
                raise ChannelClosed("a rank process exited")
            self._send_all(command)
            logits: torch.Tensor = forward()
            return logits
        except Exception as exc:  # a broken channel, or the collective failed or timed out
            if any(exc is callback_exc for callback_exc in raised):
                raise  # the caller's callback stopped the forward on every rank: the group is fine
            self.failure = self._describe_failure(exc)
            raise RankFailed(f"tensor-parallel step failed: {self.failure}") from exc

    def _describe_failure(self, exc: Exception) -> str:
        for process in self.processes:  # a rank that died is usually why; give its exit a moment to show
            process.join(0.5)
        reports = [message for channel in self.channels for message in _pending_errors(channel)]
        dead = self.dead_ranks()
        return "; ".join(reports + dead) or f"{type(exc).__name__}: {exc}"

    def _wait_ready(self, deadline: float) -> list[Any]:
        """Each rank's "ready" payload (its exported CUDA pages, or None), in rank order."""
        exported = []
        for rank, (channel, process) in enumerate(zip(self.channels, self.processes), start=1):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not channel.wait_readable(remaining, process.sentinel):
                process.join(0.5)
                raise RankFailed(f"tensor-parallel rank {rank} did not start within {self.spec.timeout_s:g} s "
                                 f"(exit code {process.exitcode})")
            message = channel.recv()
            if message[0] != "ready":
                raise RankFailed(f"tensor-parallel {message[1] if message[0] == 'error' else message}")
            exported.append(message[1])
        return exported


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
