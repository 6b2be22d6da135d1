"""Prefill and decode instances with two ranks (tiny model: 4 query, 2 KV heads) on loopback: store blocks do not
depend on the degree, so TP=2 and TP=1 instances share prompts and prefixes and give one instance's tokens; a
rank that exits fails its instance (unhealthy; serve() then exits non-zero) and requests fail, never hang."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mooncaked.config import Config
from mooncaked.model.loader import load_model
from mooncaked.roles import make_role
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.messages import (DECODE, PREFILL, RESERVE, DecodeRequest, PrefillRequest, ReserveRequest,
                                             SamplingSpec)
from mooncaked.rpc import HEALTH, HealthRequest, Internal
from mooncaked.runtime.lifecycle import EXIT_FAILED, serve
from mooncaked.runtime.sdnotify import Notifier
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.engine_reference import greedy_tokens
from tests.roles.test_disagg_roles import keys_for

NUM_NEW = 6
DEADLINE_S = 30.0
TP2 = {"settings": {"tensor_parallel_size": 2}}


def prompt(seed: int, length: int) -> list[int]:
    return [random.Random(seed).randrange(3, 300) for _ in range(length)]


async def generate(config: Config, clients: PeerClients, request_id: str, tokens: list[int], prefill_name: str,
                   inline: bool = False) -> tuple[list[int], int]:
    """Greedy tokens of `tokens` through `prefill_name` (or inline on d0) and d0; and the cached prompt tokens."""
    decode = clients.for_instance(config.instance_named("d0"))
    keys = keys_for(config, tokens)
    spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    reserve = await decode.call(RESERVE, ReserveRequest(request_id, keys, len(tokens), NUM_NEW, 10_000,
                                                        is_inline_prefill=inline), timeout_s=DEADLINE_S)
    assert reserve.is_accepted, reserve.reason
    first, num_cached = None, 0
    if not inline:
        prefill = clients.for_instance(config.instance_named(prefill_name))
        reply = await prefill.call(PREFILL, PrefillRequest(request_id, tokens, keys, spec,
                                                           decode_store=reserve.store_instance,
                                                           destinations=reserve.destinations), timeout_s=DEADLINE_S)
        first, num_cached = reply.first_token, reply.num_cached_tokens
    out = [] if first is None else [first.token_id]
    async for item in decode.stream(DECODE, DecodeRequest(request_id, tokens, keys, spec, first),
                                    timeout_s=DEADLINE_S):
        out.extend(t.token_id for t in item.tokens)
        num_cached = max(num_cached, item.num_cached_tokens)
    return out, num_cached


async def _two_requests(config: Config, tokens: list[int], first: str, second: str,
                        second_inline: bool = False) -> list[tuple[list[int], int]]:
    """The same prompt through prefill instance `first` then `second` (or inline on d0), both decoded on d0."""
    names = [i.name for i in config.cluster.instances]
    async with running_roles(config, names) as roles:
        workers = {name: roles[name].worker for name in names if name != "s0"}  # type: ignore[attr-defined]
        has_ranks = {name: worker.tp is not None for name, worker in workers.items()}
        clients = PeerClients(config, config.instance_named(first))
        try:
            results = [await generate(config, clients, "r1", tokens, first),
                       await generate(config, clients, "r2", tokens, second, inline=second_inline)]
        finally:
            await clients.close()
    assert has_ranks == {name: config.tensor_parallel_size_of(config.instance_named(name)) > 1 for name in workers}
    return results


async def test_prefill_at_tp2_then_decode_at_tp1_equals_one_instance(tmp_path: Path) -> None:
    """p0 (two ranks) writes whole store objects that d0 (one) decodes from; p0 then reuses its own prefix,
    loading each rank's KV heads of it."""
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill", **TP2),
                                       instance("d0", "decode")])
    tokens = prompt(1, 53)
    expected = greedy_tokens(load_model("random:tiny"), tokens, NUM_NEW)
    assert await _two_requests(config, tokens, "p0", "p0") == [(expected, 0), (expected, 48)]


async def test_prefill_at_tp1_then_decode_at_tp2_and_inline_prefill_at_tp2(tmp_path: Path) -> None:
    """The reverse: d0 (two ranks) loads p0's prompt into both ranks' pages; its inline prefill (gated layer by
    layer across the ranks) reuses the stored prefix too."""
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"),
                                       instance("d0", "decode", **TP2)])
    tokens = prompt(2, 40)
    expected = greedy_tokens(load_model("random:tiny"), tokens, NUM_NEW)
    assert await _two_requests(config, tokens, "p0", "p0", second_inline=True) == [(expected, 0), (expected, 32)]


async def test_a_prefix_stored_at_tp1_is_reused_by_a_tp2_prefill(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p1", "prefill"),
                                       instance("p2", "prefill", **TP2), instance("d0", "decode")])
    tokens = prompt(3, 70)
    expected = greedy_tokens(load_model("random:tiny"), tokens, NUM_NEW)
    assert await _two_requests(config, tokens, "p1", "p2") == [(expected, 0), (expected, 64)]


async def test_int8_objects_stored_at_tp1_are_reused_by_a_tp2_prefill(tmp_path: Path) -> None:
    """kv.cache_dtype int8: p2's ranks each copy their KV heads' packed rows out of p1's whole objects; decoded on
    d0, both give the same tokens (p2's device tier holds nothing of p1's prompt: the prefix comes from s0)."""
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p1", "prefill"),
                                       instance("p2", "prefill", **TP2), instance("d0", "decode")],
                            kv={"block_size": 16, "cache_dtype": "int8"})
    tokens = prompt(3, 70)
    (first, num_first), (second, num_second) = await _two_requests(config, tokens, "p1", "p2")
    assert (num_first, num_second) == (0, 64) and first == second and len(first) == NUM_NEW


async def test_a_tp2_instance_moves_whole_objects_with_another_hosts_store_through_staging(tmp_path: Path) -> None:
    """p0 (two ranks, 127.0.0.2) fetches a prefix p4 (127.0.0.4) sent to 127.0.0.3's store, into both ranks
    through staging, then writes another prompt there through staging (each KV head read from its rank's pages);
    both give one instance's tokens, and p0 holds no staging once done."""
    config = cluster_config(tmp_path, [
        instance("s2", "store", "127.0.0.2"), instance("p0", "prefill", "127.0.0.2", **TP2),
        instance("s3", "store", "127.0.0.3"), instance("d0", "decode", "127.0.0.3"),
        instance("s4", "store", "127.0.0.4"), instance("p4", "prefill", "127.0.0.4")])
    first, second = prompt(4, 45), prompt(5, 37)
    loaded = load_model("random:tiny")
    async with running_roles(config, ["s2", "s3", "s4", "p0", "d0", "p4"]) as roles:
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            assert await generate(config, clients, "r1", first, "p4") == (greedy_tokens(loaded, first, NUM_NEW), 0)
            keys = keys_for(config, first)
            fetched = await clients.for_instance(config.instance_named("p0")).call(
                PREFILL, PrefillRequest("r2", first, keys, SamplingSpec(max_tokens=1, temperature=0.0),
                                        fetch_store="s3", num_fetch_blocks=len(keys)), timeout_s=DEADLINE_S)
            assert fetched.num_fetched_blocks == 2 and fetched.num_cached_tokens == 32
            assert fetched.first_token.token_id == greedy_tokens(loaded, first, 1)[0]
            assert await generate(config, clients, "r3", second, "p0") == (greedy_tokens(loaded, second, NUM_NEW), 0)
            pool = roles["p0"].worker.staging_pool  # type: ignore[attr-defined]
            assert pool.num_buffers >= 1 and len(pool._free) == pool.num_buffers, "staging was used and given back"
        finally:
            await clients.close()


def tp2_decode_config(tmp_path: Path) -> Config:
    """A store and a decode instance d0 with two ranks, whose steps fail within 5 s of a rank's death."""
    return cluster_config(tmp_path, [instance("s0", "store"), instance("d0", "decode", **TP2)],
                          transfer={"timeout_s": 5.0})


@contextlib.asynccontextmanager
async def tp2_decode(tmp_path: Path) -> AsyncIterator[tuple[Config, Any, PeerClients]]:
    """tp2_decode_config's instances running: the config, d0's worker and clients."""
    config = tp2_decode_config(tmp_path)
    async with running_roles(config, ["s0", "d0"]) as roles:
        clients = PeerClients(config, config.instance_named("d0"))
        try:
            yield config, roles["d0"].worker, clients  # type: ignore[attr-defined]
        finally:
            await clients.close()


async def test_a_killed_rank_fails_the_instance_and_its_requests(tmp_path: Path) -> None:
    """Within the deadline the instance reports itself failed and unhealthy, and a request fails (RankFailed)
    rather than hangs."""
    async with tp2_decode(tmp_path) as (config, worker, clients):
        tokens = prompt(4, 30)
        expected = greedy_tokens(load_model("random:tiny"), tokens, NUM_NEW)
        assert await generate(config, clients, "r1", tokens, "", inline=True) == (expected, 0)
        os.kill(worker.tp.processes[0].pid, signal.SIGKILL)
        await asyncio.wait_for(worker.failed.wait(), DEADLINE_S)
        assert worker.failure.startswith("tensor-parallel rank 1 exited")
        health = await clients.for_instance(config.instance_named("d0")).call(HEALTH, HealthRequest(),
                                                                              timeout_s=DEADLINE_S)
        assert not health.is_healthy
        with pytest.raises(Internal, match="RankFailed"):
            await generate(config, clients, "r2", tokens, "", inline=True)


async def test_a_rank_killed_mid_decode_ends_the_stream_with_an_error(tmp_path: Path) -> None:
    """The rank dies while the request's tokens stream: the stream ends with RankFailed within the deadline."""
    async with tp2_decode(tmp_path) as (config, worker, clients):
        decode = clients.for_instance(config.instance_named("d0"))
        tokens = prompt(5, 20)
        keys = keys_for(config, tokens)
        spec = SamplingSpec(max_tokens=900, temperature=0.0, ignore_eos=True)
        reserve = await decode.call(RESERVE, ReserveRequest("long", keys, len(tokens), 900, 10_000,
                                                            is_inline_prefill=True), timeout_s=DEADLINE_S)
        assert reserve.is_accepted, reserve.reason
        num_items = 0
        with pytest.raises(Internal, match="RankFailed"):
            async with asyncio.timeout(DEADLINE_S):
                async for _ in decode.stream(DECODE, DecodeRequest("long", tokens, keys, spec, None),
                                             timeout_s=DEADLINE_S):
                    num_items += 1
                    if num_items == 1:  # tokens are streaming: the request is mid-decode
                        os.kill(worker.tp.processes[0].pid, signal.SIGKILL)
        assert num_items >= 1
        await asyncio.wait_for(worker.failed.wait(), DEADLINE_S)


async def test_serve_exits_non_zero_when_a_rank_exits(tmp_path: Path) -> None:
    """serve() stops the failed instance and returns EXIT_FAILED, so the supervisor restarts it whole."""
    config = tp2_decode_config(tmp_path)
    async with running_roles(config, ["s0"]):
        role = make_role(config, config.instance_named("d0"))
        assert isinstance(role, DecodeRole)
        serving = asyncio.ensure_future(serve(role, Notifier(None), None))
        try:
            await asyncio.wait_for(_until_started(role), DEADLINE_S)
            tp = role.worker.tp
            assert tp is not None
            os.kill(tp.processes[0].pid or 0, signal.SIGKILL)
            assert await asyncio.wait_for(serving, DEADLINE_S) == EXIT_FAILED
            assert (role.worker.failure or "").startswith("tensor-parallel rank 1 exited")
        finally:
            if not serving.done():
                serving.cancel()
                await asyncio.gather(serving, return_exceptions=True)


async def _until_started(role: DecodeRole) -> None:
    """The role is serving once its endpoint has bound its port (set by start, after the worker started)."""
    while role.endpoint.bound_port == 0:
        await asyncio.sleep(0.05)
