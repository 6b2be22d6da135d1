"""The runtime a prefill or decode instance is built on: one model replica, its KV pages, one compute thread.

1. `Worker(config, instance)`; `await start()`: start the transfer engine, load the model on the compute thread
   (local_replica.py; a prefill group member: only its stage's layers, config/prefill_groups.py; on CPU mapped from
   the host's shared weight file; prefill keeps plain projections, decode packed ones in their place, a switchable
   worker both: memory_plan.worker_packing), size the KV pages from the memory budget (engine.kv_budget; a budget too
   small for one max-length request fails here), allocate them (for its layers), build the runner, copier, staging pool
   (pinned on the GPU's NUMA node), sampler and grammar tokenizer (grammar.py), register the pages as a
   transfer-engine segment (host pages, which every move then reaches straight; GPU pages as "cuda:N" where RDMA
   can map them), connect to this host's store (stores.py, mapping its pool). With N > 1 tensor-parallel ranks
   (tp_worker.py) the model is rank 0's shard, the runner drives the ranks, and the KV pages are every rank's
   (mapped here; moves copy each rank's heads: roles/worker/kv/request_kv.py), so the rest of the worker is the same
   at any degree.
2. `await compute(fn, *args)` runs model work on the single compute thread, keeping the event loop free for RPC,
   transfers and heartbeats. KV copies between pages and staging run on the single copy thread
   (`copy_thread`), so a layer's store or load never runs on the compute thread; each thread may be pinned to
   its own CPUs (`worker.compute_cpus`, `worker.copy_cpus`). Layer callbacks hand work to the loop with `post`.
3. `stores` (stores.py) holds the store clients: the local store's (`stores.local`, mapping its shared-memory
   pool) and any other host's, connected on first use by `await stores.client(name)`.
4. `await stop()`: close store clients, give back staging, stop the engine, shut the compute and copy threads
   down (after the role has drained).

The worker also owns its performance model (`perf`): the role profiles it before serving (profiler.py) and feeds
it live samples; LOAD replies report its coefficients, which the conductor predicts with.

The runner does not know which role drives it (docs/design.md section 11): a decode instance prefills inline with the
same code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import secrets
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from mooncaked.cluster.membership import Membership, StaticMembership
from mooncaked.config import Config, InstanceConfig, WorkerSection
from mooncaked.config.prefill_groups import GroupStage, group_stage
from mooncaked.engine.kv_budget import KVSizing
from mooncaked.engine.kv_copy import KVCopier
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.engine.staging_pool import StagingPool
from mooncaked.engine.timeline import LayerTimeline
from mooncaked.engine.tp.runner import TensorParallelRunner
from mooncaked.kv.device_cache import DevicePrefixCache
from mooncaked.kv.device_journal import MAX_REPORTED_KEYS, DeviceCacheJournal
from mooncaked.kv.cache_dtype import namespace_dtype
from mooncaked.kv.keys import model_namespace
from mooncaked.model.config import LayerRange
from mooncaked.model.frontend import load_frontend
from mooncaked.model.loader import LoadedModel
from mooncaked.model.sampler import Sampler
from mooncaked.roles.base import PeerClients, make_transfer_engine
from mooncaked.roles.worker.grammar import WorkerGrammar
from mooncaked.roles.worker.kv.placement import register_kv_pages, staging_placement
from mooncaked.roles.worker.local_replica import load_replica
from mooncaked.roles.worker.stores import WorkerStores
from mooncaked.roles.worker.tp_worker import RankWatch, start_ranks
from mooncaked.rpc import Unavailable
from mooncaked.runtime.cpu_affinity import pinned_executor
from mooncaked.runtime.numa import allowed_memory_nodes
from mooncaked.sched.perf_model import PerformanceModel
from mooncaked.store.move_ends import Staging

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Worker:
    """Owns the model replica, KV pages and page allocator, compute and copy threads, staging pool, transfer engine,
    store clients (`stores`, stores.py) and the performance model; `timeline`, when set (tests, benchmarks),
    records when layers compute, load and store."""

    def __init__(self, config: Config, instance: InstanceConfig, membership: Membership | None = None) -> None:
        self.config = config
        self.instance = instance
        self.membership = membership or StaticMembership(config, instance)  # borrowed
        self.section: WorkerSection = config.role_section(instance)
        self.engine = make_transfer_engine(config, instance.host, 0)
        self.peers = PeerClients(config, instance)
        self.stores = WorkerStores(config, instance, self.membership, self.peers, self.engine)
        self._executor = pinned_executor("compute", self.section.compute_cpus, "worker.compute_cpus")
        self.copy_thread = pinned_executor("kv-copy", self.section.copy_cpus, "worker.copy_cpus")
        self.staging_pool: StagingPool | None = None
        self.timeline: LayerTimeline | None = None
        self.kv_pages_segment: str | None = None  # the pages' segment: host pages, or GPU pages RDMA maps
        self.host_pages: Staging | None = None  # host pages as the local end of store moves (CPU, one process)
        self._deferred_frees: dict[str, asyncio.TimerHandle] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loaded: LoadedModel | None = None
        self.kv_sizing: KVSizing | None = None
        self.kv_pages: KVPages | None = None
        self.pages: PageAllocator | None = None
        self.device_journal: DeviceCacheJournal | None = None  # the device prefix cache's changes, for LOAD replies
        self.runner: ModelRunner | TensorParallelRunner | None = None
        self.tp: TensorParallelRunner | None = None  # model.tensor_parallel_size > 1: the ranks (tp_worker.py)
        self.rank_watch: RankWatch | None = None
        self.failure: str | None = None  # why the instance cannot serve any more (a rank exited, a loop failed)
        self.failed = asyncio.Event()  # set with `failure`: the role stops and exits non-zero
        self.copier: KVCopier | None = None
        self.sampler: Sampler | None = None
        self.grammar: WorkerGrammar | None = None  # constrained decoding (grammar.py), built at start
        self.namespace = b""
        self.perf = PerformanceModel()
        self.stage: GroupStage | None = None  # this instance's place in a prefill group (set by start)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.engine.start()
        model = self.config.model
        layers = await self._find_stage()
        if self.config.tensor_parallel_size_of(self.instance) > 1:
            await self._start_ranks(layers)
        else:
            await self._load_replica(layers)
        assert self.loaded is not None and self.kv_pages is not None and self.kv_sizing is not None
        # a prefill group's stages hold a layer range each: a prefix one stage holds in its pages the others lack
        is_cached = self.config.kv.device_prefix_cache and self.stage is None
        self.pages = PageAllocator(self.kv_pages.num_pages, DevicePrefixCache() if is_cached else None)
        # numbered from a random start: a conductor's number from this instance's earlier run gets a dump
        max_keys = min(4 * self.kv_pages.num_pages, MAX_REPORTED_KEYS)  # a reply's worth at most
        self.device_journal = (DeviceCacheJournal(max_keys=max_keys, first_seq=secrets.randbits(40))
                               if is_cached else None)
        block_size = self.config.kv.block_size
        self.copier = KVCopier(self.loaded.device, backend=model.kernel_backend)
        placement = staging_placement(self.loaded.device, self.config.transfer.sysfs_root, allowed_memory_nodes())
        self.staging_pool = StagingPool(
            self.kv_pages, self.instance.name, lambda name, data: self.engine.register(name, data, placement.location),
            self.engine.unregister, numa_node=placement.numa_node)
        self._register_pages(placement.location)
        self.sampler = Sampler(seed=model.seed, device=self.loaded.device, eos_token_ids=self.loaded.eos_token_ids)
        self.grammar = await asyncio.to_thread(WorkerGrammar.build, self.loaded.tokenizer, self.vocab_size,
                                               self.loaded.eos_token_ids)
        self.namespace = model_namespace(self.loaded.model_id, namespace_dtype(model.dtype, self.config.kv.cache_dtype),
                                         block_size, self.loaded.args.kv_geometry)
        await self.stores.connect_local()
        logger.info("%s loaded %s%s; %s", self.instance.name, self.loaded.model_id,
                    f" as {self.stage.describe()}" if self.stage else "", self.kv_sizing.describe())

    def _register_pages(self, location: str) -> None:
        """Host pages are a segment every move reaches straight; GPU pages one where RDMA maps them (GPUDirect).
        A tensor-parallel instance's pages are every rank's buffer: its moves copy (request_kv.py)."""
        assert self.kv_pages is not None and self.loaded is not None
        if self.tp is not None:
            return
        pages_segment = f"{self.instance.name}/kv-pages"
        if self.loaded.device.type == "cpu":  # host pages: moves go straight to and from them, no staging
            self.engine.register(pages_segment, self.kv_pages.buffer, location)
            self.kv_pages_segment = pages_segment
            self.host_pages = Staging(pages_segment, self.kv_pages.buffer.view(-1).view(torch.uint8).numpy())
        elif register_kv_pages(self.engine, pages_segment, self.kv_pages.buffer, self.loaded.device):
            self.kv_pages_segment = pages_segment

    async def _load_replica(self, layers: LayerRange | None) -> None:
        """One process: load the model (or this stage's layers), size and allocate the pages, build the runner."""
        self.loaded, self.kv_sizing, self.kv_pages, self.runner = await load_replica(
            self.config, self.instance, self.section, layers, self.compute)

    async def _start_ranks(self, layers: LayerRange | None) -> None:
        """model.tensor_parallel_size ranks (tp_worker.py), each holding `layers` (None: all): rank 0 here, its
        runner, every rank's pages."""
        tp, sizing, self.kv_pages = await self.compute(start_ranks, self.config, self.instance, self.section,
                                                       layers)
        assert tp.shard is not None
        self.tp, self.runner, self.loaded, self.kv_sizing = tp, tp, tp.shard.loaded, sizing
        self.rank_watch = RankWatch(tp, self.fail)

    def fail(self, reason: str) -> None:
        """The instance cannot serve any more (a rank exited, a background loop failed): it reports unhealthy, and
        its role stops and exits non-zero, so the process supervisor restarts it."""
        if self.failure is None:
            self.failure = reason
            logger.error("%s failed: %s; the instance stops", self.instance.name, reason)
            self.failed.set()

    async def _find_stage(self) -> LayerRange | None:
        """This instance's stage of a prefill group (its layers), from the model's layer count; None: whole."""
        if self.config.prefill_group_of(self.instance.name) is None:
            return None
        frontend = await self.compute(load_frontend, self.config.model.source)
        self.stage = group_stage(self.config, self.instance, frontend.args.num_layers)
        return None if self.stage is None else self.stage.layers

    def free_pages_later(self, owner: str, delay_s: float) -> None:
        """Free `owner`'s pages after `delay_s`: a move abandoned mid-flight may write into them until then."""
        assert self.loop is not None
        self._deferred_frees[owner] = self.loop.call_later(delay_s, self._free_deferred, owner)

    def _free_deferred(self, owner: str) -> None:
        self._deferred_frees.pop(owner, None)
        assert self.pages is not None
        self.pages.free_owner(owner)

    async def stop(self) -> None:
        for handle in self._deferred_frees.values():  # the pages go with the worker
            handle.cancel()
        self._deferred_frees.clear()
        await self.stores.close()
        await self.peers.close()
        if self.staging_pool is not None:
            self.staging_pool.close()
        await self.engine.stop()
        # off the event loop: a forward still running may need the loop (its writes) to reach its end
        await asyncio.to_thread(self._executor.shutdown, True, cancel_futures=True)
        await asyncio.to_thread(self.copy_thread.shutdown, True, cancel_futures=True)
        if self.grammar is not None:
            await asyncio.to_thread(self.grammar.close)
        if self.rank_watch is not None:  # ranks stopping now is no failure
            self.rank_watch.close()
        if self.tp is not None:
            await asyncio.to_thread(self.tp.stop)

    async def compute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def post(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """From the compute thread: run `coro` on the event loop; the caller awaits the future later."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def member_instance(self, name: str) -> InstanceConfig:
        """Another member of this instance's prefill group; Unavailable while the membership lacks it."""
        record = self.membership.members().get(name)
        if record is None or record.role != "prefill":
            raise Unavailable(f"prefill group member {name!r} is not in the cluster now")
        return record.instance_config()

    @property
    def block_size(self) -> int:
        return self.config.kv.block_size

    @property
    def vocab_size(self) -> int:
        assert self.loaded is not None, "start() first"
        return self.loaded.args.vocab_size

    @property
    def num_pages(self) -> int:
        assert self.kv_sizing is not None
        return self.kv_sizing.num_pages

    @property
    def kv_cache_bytes(self) -> int:
        assert self.kv_sizing is not None
        return self.kv_sizing.nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one store object (every layer of the model, also on a pipeline stage)."""
        assert self.kv_pages is not None
        return self.kv_pages.object_nbytes

    @property
    def layer_nbytes(self) -> int:
        assert self.kv_pages is not None
        return self.kv_pages.layer_block_nbytes
