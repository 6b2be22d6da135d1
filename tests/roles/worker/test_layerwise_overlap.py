"""Layer-wise loading and storing overlap compute: proven by the order of a recorded timeline, not by a clock.

A prefill worker on 127.0.0.1 reuses a 3-block prefix that sits in another host's store (127.0.0.2, read over
TCP) and stores its new KV into this host's store. The stores are slowed per layer, and each delay ends on an
event only a pipelined implementation produces (with a 10 s deadline, after which the order assertions fail):
  - a read of layer i+1 ends only once layer i's compute has started;
  - every write waits WRITE_DELAY_S, and layer i+1's compute ends only once layer i's store has started;
  - on the decode side, a read of layer i ends only once layer i+1's read has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mooncaked.config import Config
from mooncaked.engine.timeline import LayerTimeline
from mooncaked.kv.keys import block_keys
from mooncaked.model.loader import load_model
from mooncaked.roles.store import StoreRole
from mooncaked.roles.worker.kv.layer_loader import LoadFailed
from mooncaked.roles.worker.kv.plan import KvPlan, plan_prompt_kv
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.roles.worker.messages import Destination, SamplingSpec
from mooncaked.roles.worker.prefill.forward import run_prefill_forward
from mooncaked.roles.worker.worker import Worker
from mooncaked.store import client as client_module
from mooncaked.store.client import StoreClient
from mooncaked.store.move_ends import Span, Staging
from mooncaked.transfer import TransferError, TransferOp
from tests.roles.cluster_fixtures import cluster_config, instance
from tests.roles.engine_reference import greedy_tokens

BLOCK = 16
NUM_LAYERS = 4  # random:small
MAX_IN_FLIGHT = 2
WRITE_DELAY_S = 0.03
DEADLINE_S = 10.0
GREEDY = SamplingSpec(max_tokens=1, temperature=0.0)


def make_config(tmp_path: Path, io_timeout_s: float = 10.0, **model: Any) -> Config:
    return cluster_config(tmp_path, [
        instance("s_local", "store", "127.0.0.1"), instance("s_remote", "store", "127.0.0.2"),
        instance("p0", "prefill", "127.0.0.1")],
        model={"source": "random:small", "max_model_len": 512, **model},
        worker={"max_layers_in_flight": MAX_IN_FLIGHT, "num_kv_pages": 64},
        transfer={"timeout_s": 10.0, "io_timeout_s": io_timeout_s})


@contextlib.asynccontextmanager
async def running_worker(config: Config) -> AsyncIterator[Worker]:
    stores = [StoreRole(config, config.instance_named(name)) for name in ("s_local", "s_remote")]
    worker = Worker(config, config.instance_named("p0"))
    try:
        for store in stores:
            await store.start()
        await worker.start()
        yield worker
    finally:
        await worker.stop()
        for store in reversed(stores):
            await store.stop()


def keys_of(worker: Worker, tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, worker.block_size, worker.namespace)


async def prefill(worker: Worker, plans: Sequence[KvPlan]) -> list[int]:
    result = await worker.compute(run_prefill_forward, worker, plans, [GREEDY] * len(plans))
    return [s.token_id for s in result.first_tokens]


async def seed_remote_prefix(worker: Worker, tokens: list[int]) -> None:
    """Compute `tokens`' KV and commit it into s_remote only (this host's store keeps nothing)."""
    keys = keys_of(worker, tokens)
    remote = await worker.stores.client("s_remote")
    reply = await remote.allocate(keys, worker.block_nbytes, 60_000)
    plan = await plan_prompt_kv(worker, "seed", tokens + [5], keys, timeout_s=30, decode_store="s_remote",
                                destinations=[Destination(i, h) for i, h in enumerate(reply.handles)])
    plan.local_handles = []
    try:
        await prefill(worker, [plan])
        await plan.kv.wait_writes(30)
        await remote.commit([h.handle_id for h in reply.handles])
    finally:
        await plan.close(commit=False)


async def load_first_two_blocks(worker: Worker, keys: list[bytes], num_tokens: int, expected: torch.Tensor) -> None:
    """A new request's pages get the first two blocks of `keys` from this host's store; they equal `expected`."""
    found = await worker.stores.local.lookup(keys, lease_ms=30_000)
    kv = RequestKv(worker, "decode", num_tokens, 4)
    try:
        kv.start_loading([StoreBlocks("s_local", [0, 1], [loc.offset for loc in found.locations])], 2)
        await kv.wait_loaded()
        assert torch.equal(worker.kv_pages.buffer[:, :, kv.page_ids[:2]], expected)  # type: ignore[union-attr]
    finally:
        await kv.release()
        await worker.stores.local.release([found.read_lease_id])


def staging_layer(worker: Worker, spans: Sequence[Span]) -> int:
    """The layer a layer-wise move is about, from where its first span lies in the pages or in staging."""
    kv_pages = worker.kv_pages
    assert kv_pages is not None
    if worker.host_pages is not None:  # [layers, 2, pages, ...]
        return spans[0].staging_offset // (2 * kv_pages.num_pages * kv_pages.page_nbytes)
    return (spans[0].staging_offset % worker.block_nbytes) // worker.layer_nbytes


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.002)


def recorded(timeline: LayerTimeline, kind: Any, layer: int, edge: Any) -> bool:
    return any(e.kind == kind and e.layer == layer and e.edge == edge for e in timeline.events())


def slow_down(client: StoreClient, delay: Callable[[TransferOp, int], Any], worker: Worker,
              monkeypatch: pytest.MonkeyPatch) -> None:
    move = client.move

    async def delayed_move(op: TransferOp, staging: Staging, spans: Sequence[Span], **kwargs: Any) -> None:
        if spans:
            await delay(op, staging_layer(worker, spans))
        await move(op, staging, spans, **kwargs)

    monkeypatch.setattr(client, "move", delayed_move)


def record_move_ends(client: StoreClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The segment name of the local end of each of `client`'s moves from now on."""
    names: list[str] = []
    move = client.move

    async def recorded_move(op: TransferOp, staging: Staging, spans: Sequence[Span], **kwargs: Any) -> None:
        names.append(staging.name)
        await move(op, staging, spans, **kwargs)

    monkeypatch.setattr(client, "move", recorded_move)
    return names


async def prefill_to_remote(worker: Worker, request_id: str, tokens: list[int], keys: list[bytes],
                            check: Callable[[KvPlan], None]) -> None:
    """Prefill `tokens` here with every block sent to the store of 127.0.0.2 too, committed in both; `check`
    looks at the plan before the forward."""
    remote = await worker.stores.client("s_remote")
    reply = await remote.allocate(keys, worker.block_nbytes, 60_000)
    plan = await plan_prompt_kv(worker, request_id, tokens, keys, timeout_s=30, decode_store="s_remote",
                                destinations=[Destination(i, h) for i, h in enumerate(reply.handles)])
    try:
        check(plan)
        await prefill(worker, [plan])
        await plan.kv.wait_writes(30)
        await plan.close_store(commit=True)
        await remote.commit([h.handle_id for h in reply.handles])
    finally:
        await plan.close(commit=False)


async def assert_same_objects_here_and_there(worker: Worker, keys: list[bytes]) -> None:
    """This host's store and 127.0.0.2's hold every block of `keys`, the same bytes (not all zeros)."""
    remote = await worker.stores.client("s_remote")
    here, there = await worker.stores.local.lookup(keys, 30_000), await remote.lookup(keys, 30_000)
    assert len(here.locations) == len(there.locations) == len(keys)
    buffers = [np.zeros(len(keys) * worker.block_nbytes, np.uint8) for _ in range(2)]
    await worker.stores.local.read_blocks(worker.stores.local.register_staging("here", buffers[0]), here.locations)
    await remote.read_blocks(remote.register_staging("there", buffers[1]), there.locations)
    assert buffers[0][: worker.block_nbytes].any() and np.array_equal(buffers[0], buffers[1])


def gate_compute_ends(worker: Worker, timeline: LayerTimeline) -> list[Any]:
    """Layer i+1's compute ends only once layer i's store has started (or the deadline passed)."""
    assert worker.loaded is not None

    def wait_for_store(layer: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not recorded(timeline, "store", layer - 1, "start") and time.monotonic() < deadline:
            time.sleep(0.001)

    return [layer.register_forward_hook(lambda module, args, out, i=i: wait_for_store(i) if i else None)
            for i, layer in enumerate(worker.loaded.model.layers)]


def max_overlapping(timeline: LayerTimeline, kind: Any, request_id: str) -> int:
    spans = {}
    for event in timeline.events():
        if event.kind == kind and event.request_id == request_id:
            spans.setdefault(event.layer, [0.0, float("inf")])[0 if event.edge == "start" else 1] = event.at
    return max(sum(1 for s, e in spans.values() if s <= start < e) for start, _ in spans.values())


async def test_prefill_loads_and_stores_overlap_compute_layer_by_layer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await check_prefill_overlap(make_config(tmp_path), monkeypatch)


async def check_prefill_overlap(config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill of a prompt with a 3-block prefix in the other host's store, under the delays above."""
    rng = random.Random(3)
    tokens = [rng.randrange(3, 300) for _ in range(3 * BLOCK + 20)]
    is_cpu = config.model.device == "cpu"
    expected = greedy_tokens(load_model("random:small"), tokens, 1)[0] if is_cpu else None
    async with running_worker(config) as worker:
        await seed_remote_prefix(worker, tokens[: 3 * BLOCK])
        timeline = LayerTimeline()
        worker.timeline = timeline

        async def delay(op: TransferOp, layer: int) -> None:
            if op is TransferOp.READ and layer > 0:
                await until(lambda: recorded(timeline, "compute", layer - 1, "start"))
            elif op is TransferOp.WRITE:
                await asyncio.sleep(WRITE_DELAY_S)

        slow_down(await worker.stores.client("s_remote"), delay, worker, monkeypatch)
        slow_down(worker.stores.local, delay, worker, monkeypatch)
        hooks = gate_compute_ends(worker, timeline)
        plan = await plan_prompt_kv(worker, "r1", tokens, keys_of(worker, tokens), timeout_s=30,
                                    fetch_store="s_remote", num_fetch_blocks=3)
        try:
            assert plan.num_prefix_blocks == 3 and plan.num_fetched_blocks == 3
            first = await prefill(worker, [plan])
            assert expected is None or first == [expected]
            await plan.kv.wait_writes(30)
            await plan.close_store(commit=True)
        finally:
            for hook in hooks:
                hook.remove()
            await plan.close(commit=False)
        stored = await worker.stores.local.lookup(keys_of(worker, tokens))
        assert len(stored.locations) == 4, "the fetched prefix and the new full block were stored here"

    def at(kind: Any, layer: int, edge: Any) -> float:
        return timeline.time_of(kind, layer, edge)

    for i in range(NUM_LAYERS - 1):
        assert at("load", i + 1, "start") < at("compute", i, "end"), f"layer {i + 1}'s load waited for compute"
        assert at("compute", i, "start") < at("load", i + 1, "end"), f"layer {i} waited for layer {i + 1}'s load"
        assert at("store", i, "start") < at("compute", i + 1, "end"), f"layer {i}'s store waited for compute"
    assert max_overlapping(timeline, "store", "r1") <= MAX_IN_FLIGHT
    assert max_overlapping(timeline, "load", "r1") <= MAX_IN_FLIGHT


async def test_decode_side_loading_is_pipelined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(tmp_path)
    tokens = [random.Random(4).randrange(3, 300) for _ in range(2 * BLOCK + 5)]
    async with running_worker(config) as worker:
        keys = keys_of(worker, tokens)
        plan = await plan_prompt_kv(worker, "p", tokens, keys, timeout_s=30)
        await prefill(worker, [plan])
        await plan.kv.wait_writes(30)
        await plan.close_store(commit=True)
        pages = plan.kv.page_ids
        expected = worker.kv_pages.buffer[:, :, pages[:2]].clone()  # type: ignore[union-attr]
        await plan.kv.release()
        timeline = LayerTimeline()
        worker.timeline = timeline

        async def delay(op: TransferOp, layer: int) -> None:
            if op is TransferOp.READ and layer + 1 < NUM_LAYERS:
                await until(lambda: recorded(timeline, "load", layer + 1, "start"))

        slow_down(worker.stores.local, delay, worker, monkeypatch)
        await load_first_two_blocks(worker, keys, len(tokens), expected)
    for i in range(NUM_LAYERS - 1):
        assert timeline.time_of("load", i + 1, "start") < timeline.time_of("load", i, "end")


async def test_a_failed_load_fails_its_request_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(tmp_path, io_timeout_s=0.2)
    rng = random.Random(5)
    broken, fine = ([rng.randrange(3, 300) for _ in range(2 * BLOCK + 3)] for _ in range(2))
    expected = greedy_tokens(load_model("random:small"), fine, 1)[0]
    async with running_worker(config) as worker:
        await seed_remote_prefix(worker, broken[: 2 * BLOCK])
        num_free_pages = worker.pages.num_free  # type: ignore[union-attr]

        async def delay(op: TransferOp, layer: int) -> None:
            if op is TransferOp.READ and layer == 2:
                raise TransferError("injected: the remote store went away")

        slow_down(await worker.stores.client("s_remote"), delay, worker, monkeypatch)
        plans = [await plan_prompt_kv(worker, "broken", broken, keys_of(worker, broken), timeout_s=30,
                                      fetch_store="s_remote", num_fetch_blocks=2),
                 await plan_prompt_kv(worker, "fine", fine, keys_of(worker, fine), timeout_s=30)]
        try:
            assert (await prefill(worker, plans))[1] == expected
            with pytest.raises(LoadFailed, match="layer 2: TransferError: injected"):
                await plans[0].kv.wait_writes(30)
            await plans[1].kv.wait_writes(30)
        finally:
            for plan in plans:
                await plan.close(commit=False)
        # the failed request's pages took an abandoned move: they are freed after transfer.io_timeout_s
        await until(lambda: worker.pages.num_free == num_free_pages)  # type: ignore[union-attr]
        assert worker.pages.num_free == num_free_pages  # type: ignore[union-attr]


async def test_the_copy_thread_runs_the_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order above also holds for copies on the compute thread; this is the rest: same-host moves between
    the pages and this host's store run on the copy thread."""
    config = make_config(tmp_path)
    tokens = [random.Random(6).randrange(3, 300) for _ in range(BLOCK + 3)]
    async with running_worker(config) as worker:
        threads: set[str] = set()
        copy_spans = client_module._copy_spans

        def spy(*args: Any) -> None:
            threads.add(threading.current_thread().name)
            copy_spans(*args)

        monkeypatch.setattr(client_module, "_copy_spans", spy)
        plan = await plan_prompt_kv(worker, "t", tokens, keys_of(worker, tokens), timeout_s=30)
        try:
            await prefill(worker, [plan])
            await plan.kv.wait_writes(30)
        finally:
            await plan.close(commit=False)
        assert threads and all(name.startswith("kv-copy") for name in threads)


async def test_pages_go_straight_into_another_hosts_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host pages are a segment: the other host's store gets layer i of each block from two page ranges (K, V),
    no staging copy (the byte layout GPUDirect uses too); its objects equal this host's."""
    config = make_config(tmp_path)
    tokens = [random.Random(8).randrange(3, 300) for _ in range(2 * BLOCK + 7)]
    async with running_worker(config) as worker:
        assert worker.kv_pages_segment == "p0/kv-pages" and worker.host_pages is not None
        keys = keys_of(worker, tokens)
        sources = record_move_ends(await worker.stores.client("s_remote"), monkeypatch)

        def check(plan: KvPlan) -> None:
            assert plan.kv.is_direct and plan.kv.staging.buffer is None

        await prefill_to_remote(worker, "g", tokens, keys, check)
        assert sources == ["p0/kv-pages"] * NUM_LAYERS, "every layer went from the pages"
        await assert_same_objects_here_and_there(worker, keys)


async def test_a_cancelled_release_still_gives_the_pages_back_at_once(tmp_path: Path) -> None:
    """A stream handler is often cancelled as its request ends; with nothing left running, release frees the
    pages before it could be interrupted (it awaits nothing)."""
    config = make_config(tmp_path)
    tokens = [random.Random(9).randrange(3, 300) for _ in range(2 * BLOCK + 3)]
    async with running_worker(config) as worker:
        assert worker.pages is not None
        num_free = worker.pages.num_free
        plan = await plan_prompt_kv(worker, "s", tokens, keys_of(worker, tokens), timeout_s=30)
        await prefill(worker, [plan])
        await plan.kv.wait_writes(30)
        await plan.close_store(commit=True)
        await plan.kv.release()
        reuse = await plan_prompt_kv(worker, "c", tokens, keys_of(worker, tokens), timeout_s=30)
        await reuse.kv.wait_loaded()
        await reuse.close_store(commit=False)

        async def cancelled_caller() -> None:
            current = asyncio.current_task()
            assert current is not None
            current.cancel()
            await reuse.kv.release()
            await asyncio.sleep(0)  # the cancellation lands here, after the release

        await asyncio.gather(asyncio.ensure_future(cancelled_caller()), return_exceptions=True)
        assert worker.pages.num_free == num_free
