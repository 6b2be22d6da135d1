"""One rank of a tensor-parallel model: its process group membership, its shard, its KV pages, its runner.

1. `RankSpec` is everything a rank needs to build its part (picklable: it crosses into spawned processes).
2. `join_group(spec, rank, num_ranks, store)` joins the ranks' group (gloo over loopback on CPU, NCCL on CUDA,
   the rank's own device `cuda:<base + rank>`) with `spec.timeout_s` as every collective's deadline. The layers'
   all-reduces (model.tensor_parallel's installed Reducer) go through NCCL on CUDA, and on CPU through a
   shared-memory segment of the host (engine.tp.shm; gloo for what does not fit it, or with it switched off).
3. `build_rank(spec, rank, num_ranks)` loads the rank's shard (only its heads and MLP columns) and allocates
   pages for its KV heads (with `spec.is_pages_shared`, on CPU in the memory rank 0 passed, on CUDA exported to
   rank 0 with the rank's "ready": engine/tp_pages.py).
4. `rank_main` (the entry of ranks 1..N-1, spawned by engine.tp.runner): join, build, report ready, then run
   every forward rank 0 sends, in order, until `stop`, until rank 0's process exits, or until a forward fails
   (the rank reports the error on its channel and exits: rank 0's collectives then fail, never hang).
5. A prefill rank 0 runs with layer callbacks (a worker instance's loads and stores) is gated: before each layer
   and after the last one the rank waits for rank 0's "go" (its callback passed: layer i's KV is in the rank's
   pages) or "abort" (the callback raised: the forward stops there on every rank, at the same layer boundary,
   so no collective is left half-joined, and the rank serves the next command).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import os
import select
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from mooncaked.engine.batch import DecodeBatch, PrefillBatch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.engine.tp import shm as tp_shm
from mooncaked.engine.tp.channel import ChannelClosed, RankChannel
from mooncaked.engine.tp.pages import SharedPages, export_device_pages
from mooncaked.model import tensor_parallel
from mooncaked.model.config import LayerRange
from mooncaked.model.loader import LoadedModel, load_model, model_args, resolve_dtype
from mooncaked.model.packed_gemm import Packing
from mooncaked.model.tensor_parallel import TensorParallelError, shard_shape

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
BatchT = TypeVar("BatchT", PrefillBatch, DecodeBatch)


@dataclass(frozen=True)
class RankSpec:
    source: str  # model source (loader syntax)
    num_pages: int  # KV pages per rank (each holds the rank's KV heads)
    block_size: int
    dtype: str = "float32"
    device: str = "cpu"  # cpu, or cuda / cuda:N (rank r then runs on cuda:N+r)
    seed: int = 0
    packing: Packing = "plain"
    backend: str = "auto"  # kernel backend
    num_threads: int = 1  # torch intra-op threads per rank
    timeout_s: float = 60.0  # deadline of the rendezvous, every collective and every command send
    allreduce_slot_bytes: int = 8 << 20  # CPU: all-reduces up to this size go through shared memory; 0: gloo only
    is_pages_shared: bool = False  # ranks' pages are mapped in rank 0 too (a worker instance's moves)
    layers: LayerRange | None = None  # a pipeline stage's layers (a prefill group member); None: every layer
    is_expert_parallel: bool = False  # MoE experts partitioned whole across the ranks (else column-sharded)
    cache_dtype: str = "auto"  # kv.cache_dtype: the rows every rank's pages hold (kv/cache_dtype.py)


@dataclass(frozen=True)
class RankShard:
    loaded: LoadedModel
    kv_pages: KVPages
    runner: ModelRunner


def rank_device(device: str, rank: int) -> str:
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return device
    return f"cuda:{(parsed.index or 0) + rank}"


def check_devices(spec: RankSpec, num_ranks: int) -> None:
    """Refuse a CUDA degree the host's devices cannot hold (rank r runs on cuda:N+r), before spawning ranks."""
    if not is_cuda(spec):
        return
    first = torch.device(spec.device).index or 0
    available = torch.cuda.device_count()
    if first + num_ranks > available:
        raise TensorParallelError(f"tensor_parallel_size {num_ranks} on {spec.device} needs CUDA devices cuda:{first}.."
                         f"cuda:{first + num_ranks - 1}, one per rank; this host has {available}: lower "
                         f"model.tensor_parallel_size or pick another first device")


def join_group(spec: RankSpec, rank: int, num_ranks: int, store: dist.Store) -> Any:
    """Join the ranks' group (blocks until all have, or `spec.timeout_s`); returns its c10d backend."""
    timeout = timedelta(seconds=spec.timeout_s)
    if is_cuda(spec):
        torch.cuda.set_device(torch.device(rank_device(spec.device, rank)))
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, num_ranks, nccl_options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]  # loopback only
    return dist.ProcessGroupGloo(store, rank, num_ranks, options)


def is_cuda(spec: RankSpec) -> bool:
    return torch.device(spec.device).type == "cuda"


def uses_shared_memory(spec: RankSpec) -> bool:
    """Whether the ranks all-reduce through shared memory (engine.tp.shm) rather than the group alone."""
    return not is_cuda(spec) and spec.allreduce_slot_bytes > 0 and tp_shm.is_supported()


class BackendReducer:
    """All-reduce through the group's backend (NCCL; gloo where shared memory is off)."""

    def __init__(self, backend: Any, num_ranks: int) -> None:
        self.backend = backend
        self.num_ranks = num_ranks

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.backend.allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tp_shm.gather_through(self.backend, tensor, self.num_ranks)


def _join_reducer(spec: RankSpec, rank: int, num_ranks: int, store: dist.Store,
                  channel: RankChannel) -> tensor_parallel.Reducer:
    """A spawned rank's reducer (the shared segment's fd comes first on the channel)."""
    backend = join_group(spec, rank, num_ranks, store)
    if not uses_shared_memory(spec):
        return BackendReducer(backend, num_ranks)
    parent = multiprocessing.parent_process()
    sentinel = None if parent is None else parent.sentinel
    return tp_shm.SharedMemoryReducer(channel.recv_fds(1 + num_ranks), rank, num_ranks, spec.allreduce_slot_bytes,
                                      spec.timeout_s, backend, lambda: _has_exited(sentinel))


def _has_exited(sentinel: int | None) -> bool:
    return sentinel is not None and bool(select.select([sentinel], [], [], 0)[0])


def build_rank(spec: RankSpec, rank: int, num_ranks: int, pages_buffer: torch.Tensor | None = None) -> RankShard:
    shard = shard_shape(model_args(spec.source), rank, num_ranks, spec.is_expert_parallel)
    device = rank_device(spec.device, rank)
    loaded = load_model(spec.source, dtype=spec.dtype, device=device, seed=spec.seed, packing=spec.packing,
                        layers=spec.layers, shard=shard)
    kv_pages = KVPages.for_model(loaded.args, num_pages=spec.num_pages, block_size=spec.block_size,
                                 dtype=loaded.dtype, device=device, layers=spec.layers, shard=shard,
                                 buffer=pages_buffer, cache_dtype=spec.cache_dtype)
    return RankShard(loaded, kv_pages, ModelRunner(loaded.model, kv_pages, backend=spec.backend))


def rank_main(spec: RankSpec, rank: int, num_ranks: int, port: int, sock: socket.socket) -> None:
    """Entry of a spawned rank (1..N-1)."""
    channel = RankChannel(sock, spec.timeout_s)
    torch.set_num_threads(spec.num_threads)
    try:
        store = dist.TCPStore(LOOPBACK, port, num_ranks, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
        tensor_parallel.install_group(_join_reducer(spec, rank, num_ranks, store, channel))
        pages = _attach_pages(spec, rank, num_ranks, channel) if spec.is_pages_shared and not is_cuda(spec) else None
        shard = build_rank(spec, rank, num_ranks, None if pages is None else pages.tensor)
        is_exported = spec.is_pages_shared and is_cuda(spec)
        gc.collect()
        gc.freeze()  # the process serves this shard only: no full collection walks the model again (lifecycle.py)
        channel.send(("ready", export_device_pages(shard.kv_pages.buffer) if is_exported else None))
        _serve(channel, shard.runner)
    except Exception as exc:  # report, then exit at once: tearing down a broken group could block
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            channel.send(("error", f"rank {rank}: {exc!r}"))
        except ChannelClosed:
            pass
        os._exit(1)
    tensor_parallel.remove_group()


def pages_nbytes(spec: RankSpec, rank: int, num_ranks: int) -> int:
    args = model_args(spec.source)
    dtype = resolve_dtype(spec.dtype, spec.device)
    return KVPages.nbytes_for(args, shard_shape(args, rank, num_ranks, spec.is_expert_parallel), spec.num_pages, spec.block_size, dtype,
                              spec.layers, spec.cache_dtype)


def _attach_pages(spec: RankSpec, rank: int, num_ranks: int, channel: RankChannel) -> SharedPages:
    """Map the pages rank 0 created for this rank (their fd follows the all-reduce segment's on the channel)."""
    (fd,) = channel.recv_fds(1)
    return SharedPages.attach(fd, pages_nbytes(spec, rank, num_ranks))


def batch_to_wire(batch: PrefillBatch | DecodeBatch) -> dict[str, Any]:
    """A batch's fields with numpy arrays for tensors: pickled ~20x faster than tensors (which pickle through
    torch's storage serialization), and a decode step sends one per rank."""
    return {f.name: _to_numpy(getattr(batch, f.name)) for f in dataclasses.fields(batch)}


def batch_from_wire(cls: type[BatchT], fields: dict[str, Any], device: torch.device) -> BatchT:
    values: dict[str, Any] = {name: torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v
                              for name, v in fields.items()}
    return cls(**values)


def _to_numpy(value: Any) -> Any:
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else value


class ForwardAborted(Exception):
    """Rank 0 stopped this forward at a layer boundary (its layer callback raised)."""


class _LayerGate:
    """A gated prefill's callbacks on a rank other than 0: wait for rank 0's go at each layer boundary."""

    def __init__(self, channel: RankChannel, sentinel: int | None, num_layers: int) -> None:
        self.channel = channel
        self.sentinel = sentinel
        self.last_layer = num_layers - 1

    def before_layer(self, layer: int) -> None:
        self._wait()

    def after_layer(self, layer: int) -> None:
        if layer == self.last_layer:
            self._wait()

    def _wait(self) -> None:
        # no deadline of its own: rank 0 bounds its callbacks by theirs, and its exit ends the wait
        if not self.channel.wait_readable(None, self.sentinel):
            raise ForwardAborted("rank 0's process exited")
        message = self.channel.recv()
        if message[0] == "abort":
            raise ForwardAborted("rank 0 stopped the forward")
        if message[0] != "go":
            raise ValueError(f"expected go or abort at a layer boundary, got {message[0]!r}")


def _serve(channel: RankChannel, runner: ModelRunner) -> None:
    device = runner.kv_pages.device
    # A replicated output head comes after every collective: ranks > 0 skip it (only rank 0 returns logits),
    # leaving the memory bandwidth to rank 0's copy. A vocabulary-split one all-gathers: every rank runs it.
    is_head_replicated = runner.model.shape.vocab_size is None
    parent = multiprocessing.parent_process()
    sentinel = None if parent is None else parent.sentinel
    gate = _LayerGate(channel, sentinel, runner.kv_pages.num_layers)
    while channel.wait_readable(None, sentinel):  # idle until a command comes or rank 0's process exits
        message = channel.recv()
        if message[0] == "stop":
            return
        if message[0] == "prefill":
            _, wire, return_all_logits, is_gated, hidden_in, return_hidden = message
            try:
                runner.prefill(batch_from_wire(PrefillBatch, wire, device), return_all_logits=return_all_logits,
                               hidden_in=None if hidden_in is None else hidden_in.to(device),
                               return_hidden=return_hidden or is_head_replicated,
                               before_layer=gate.before_layer if is_gated else None,
                               after_layer=gate.after_layer if is_gated else None)
            except ForwardAborted:
                continue
        elif message[0] == "decode":
            runner.decode(batch_from_wire(DecodeBatch, message[1], device), return_hidden=is_head_replicated)
        else:
            raise ValueError(f"unknown tensor-parallel command {message[0]!r}")
    logger.warning("rank 0's process exited; this tensor-parallel rank stops")
