"""Store + prefill + decode roles driven over RPC the way the conductor drives them (tiny random model)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from mooncaked.config import Config
from mooncaked.kv.cache_dtype import namespace_dtype
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.messages import (DECODE, PREFILL, RESERVE, DecodeRequest, PrefillRequest, ReserveRequest,
                                             SamplingSpec)
from mooncaked.rpc import RpcClient
from mooncaked.transfer import SegmentRef, TransferEngine, TransferError, TransferOp, TransferRequest
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.engine_reference import greedy_tokens


def keys_for(config: Config, tokens: list[int]) -> list[bytes]:
    loaded = load_model(config.model.source, dtype=config.model.dtype, seed=config.model.seed)
    namespace = model_namespace(loaded.model_id, namespace_dtype(config.model.dtype, config.kv.cache_dtype),
                                config.kv.block_size, loaded.args.kv_geometry)
    return block_keys(tokens, config.kv.block_size, namespace)


async def generate(config: Config, clients: PeerClients, request_id: str, tokens: list[int], max_tokens: int,
                   inline: bool = False) -> tuple[list[int], int]:
    decode: RpcClient = clients.for_instance(config.instance_named("d0"))
    prefill: RpcClient = clients.for_instance(config.instance_named("p0"))
    keys = keys_for(config, tokens)
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reserve = await decode.call(RESERVE, ReserveRequest(request_id, keys, len(tokens), max_tokens, 10_000,
                                                        is_inline_prefill=inline), timeout_s=10)
    assert reserve.is_accepted, reserve.reason
    first = None
    num_cached = 0
    if not inline:
        reply = await prefill.call(PREFILL, PrefillRequest(request_id, tokens, keys, spec, decode_store=reserve.store_instance,
                                                           destinations=reserve.destinations), timeout_s=30)
        first, num_cached = reply.first_token, reply.num_cached_tokens
    out = [] if first is None else [first.token_id]
    async for item in decode.stream(DECODE, DecodeRequest(request_id, tokens, keys, spec, first), timeout_s=30):
        out.extend(t.token_id for t in item.tokens)
        num_cached = max(num_cached, item.num_cached_tokens)
        if item.finish_reason:
            assert item.finish_reason == "length"
    return out, num_cached


@pytest.mark.parametrize("num_tokens", [37, 64])
async def test_prefill_then_decode_equals_single_process(tmp_path: Path, num_tokens: int) -> None:
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")])
    tokens = [random.Random(num_tokens).randrange(3, 300) for _ in range(num_tokens)]
    expected = greedy_tokens(load_model("random:tiny"), tokens, 8)
    async with running_roles(config, ["s0", "p0", "d0"]):
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            out, num_cached = await generate(config, clients, "r1", tokens, 8)
            assert out == expected and num_cached == 0
            out2, num_cached2 = await generate(config, clients, "r2", tokens, 8)
            assert out2 == expected and num_cached2 == (num_tokens - 1) // 16 * 16
            out3, _ = await generate(config, clients, "r3", tokens, 8, inline=True)
            assert out3 == expected
        finally:
            await clients.close()


async def test_inline_overhead_leaves_out_the_wait_for_the_compute_thread(tmp_path: Path) -> None:
    """The conductor predicts an inline prefill's wait for the compute thread itself (view.instances.inline_wait_s):
    the overhead the decode instance reports is the rest (planning, writes), however long the thread was busy."""
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")])
    async with running_roles(config, ["s0", "d0"]) as roles:
        decode = roles["d0"]
        assert isinstance(decode, DecodeRole)
        clients = PeerClients(config, config.instance_named("d0"))
        busy_s = 1.0
        thread_busy = asyncio.ensure_future(decode.worker.compute(time.sleep, busy_s))  # a long decode step, say
        try:
            out, _ = await generate(config, clients, "r1", list(range(3, 40)), 2, inline=True)
            assert len(out) == 2 and thread_busy.done()  # the prefill ran after the busy thread
        finally:
            await thread_busy
            await clients.close()
        assert 0.0 <= decode.inline.overhead.value < busy_s / 2


async def test_cross_host_tcp_and_remote_prefix_fetch(tmp_path: Path) -> None:
    """Stores on 127.0.0.2/.3/.4: prefill on .2 streams KV to decode on .3 over TCP; prefill on .4 fetches the
    prefix from .2's store, and serves it from its own store the next time."""
    config = cluster_config(tmp_path, [
        instance("s2", "store", "127.0.0.2"), instance("p0", "prefill", "127.0.0.2"),
        instance("s3", "store", "127.0.0.3"), instance("d0", "decode", "127.0.0.3"),
        instance("s4", "store", "127.0.0.4"), instance("p4", "prefill", "127.0.0.4"),
    ])
    tokens = [random.Random(7).randrange(3, 300) for _ in range(80)]
    expected = greedy_tokens(load_model("random:tiny"), tokens, 6)
    async with running_roles(config, ["s2", "s3", "s4", "p0", "d0", "p4"]) as roles:
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            out, _ = await generate(config, clients, "r1", tokens, 6)
            assert out == expected
            prefill4: RpcClient = clients.for_instance(config.instance_named("p4"))
            keys = keys_for(config, tokens)
            spec = SamplingSpec(max_tokens=1, temperature=0.0)
            fetched = await prefill4.call(PREFILL, PrefillRequest("r2", tokens, keys, spec, fetch_store="s2",
                                                                  num_fetch_blocks=len(keys)), timeout_s=30)
            assert fetched.num_fetched_blocks == 4 and fetched.num_cached_tokens == 64
            assert fetched.fetch_s > 0  # what the conductor measures the link from
            assert fetched.first_token.token_id == expected[0]
            local = await prefill4.call(PREFILL, PrefillRequest("r3", tokens, keys, spec), timeout_s=30)
            assert local.num_fetched_blocks == 0 and local.num_cached_tokens == 64
            assert local.first_token.token_id == expected[0]
            worker = roles["p0"].worker  # type: ignore[attr-defined]
            assert not worker.stores.local.is_local or worker.stores.local_name == "s2"
            assert not (await worker.stores.client("s3")).is_local  # bytes to .3 went through TCP
        finally:
            await clients.close()


async def test_concurrent_prefills_share_a_batch(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill")])
    loaded = load_model("random:tiny")
    prompts = [[random.Random(seed).randrange(3, 300) for _ in range(20 + 7 * seed)] for seed in range(4)]
    expected = [greedy_tokens(loaded, tokens, 1)[0] for tokens in prompts]
    async with running_roles(config, ["s0", "p0"]) as roles:
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            prefill: RpcClient = clients.for_instance(config.instance_named("p0"))
            spec = SamplingSpec(max_tokens=1, temperature=0.0)
            replies = await asyncio.gather(*(
                prefill.call(PREFILL, PrefillRequest(f"b{i}", tokens, keys_for(config, tokens), spec), timeout_s=30)
                for i, tokens in enumerate(prompts)))
            assert [r.first_token.token_id for r in replies] == expected
            batch_sizes = roles["p0"].metrics.engine.batch_size  # type: ignore[attr-defined]
            samples = {s.name: s.value for metric in batch_sizes.collect() for s in metric.samples}
            assert samples["mooncaked_batch_size_sum"] > samples["mooncaked_batch_size_count"]  # some batch > 1
        finally:
            await clients.close()


async def test_with_a_secret_kv_moves_between_hosts_and_no_one_else_reads_the_pool(tmp_path: Path) -> None:
    """cluster.secret_file set: prefill on 127.0.0.2 streams KV to decode on 127.0.0.3 over authenticated data
    connections; an engine without the secret reads nothing from a store's pool."""
    secret = tmp_path / "secret"
    secret.write_text("a shared secret\n")
    config = cluster_config(tmp_path, [
        instance("s2", "store", "127.0.0.2"), instance("p0", "prefill", "127.0.0.2"),
        instance("s3", "store", "127.0.0.3"), instance("d0", "decode", "127.0.0.3"),
    ], cluster={"secret_file": str(secret)})
    tokens = [random.Random(11).randrange(3, 300) for _ in range(48)]
    expected = greedy_tokens(load_model("random:tiny"), tokens, 4)
    async with running_roles(config, ["s2", "s3", "p0", "d0"]) as roles:
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            out, _ = await generate(config, clients, "r1", tokens, 4)
            assert out == expected
            store = roles["s3"]
            pool = SegmentRef(store.engine.endpoint, store.service.segment_name)  # type: ignore[attr-defined]
            for secret_bytes in (None, b"a guessed secret"):
                intruder = TransferEngine(host="127.0.0.9", cluster_id=config.cluster.id, secret=secret_bytes)
                await intruder.start()
                try:
                    intruder.register("loot", bytearray(4096))
                    batch = intruder.submit([TransferRequest(TransferOp.READ, "loot", 0, pool, 0, 4096)])
                    with pytest.raises(TransferError, match="secret"):
                        await intruder.wait(batch, timeout_s=10)
                finally:
                    await intruder.stop()
        finally:
            await clients.close()
