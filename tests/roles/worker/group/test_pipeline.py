"""A prefill group (chunked pipeline parallelism) against a single prefill instance, on loopback, tiny model.

Group g0 + g1 (one layer each) on 127.0.0.1 with store s1 and decode d1; a single instance p2 on 127.0.0.2 with
store s2, its prefill_chunk equal to the group's cpp_chunk_tokens so both cut the prompt at the same tokens:
  - the first token and the decode stream through the group equal the one-process reference;
  - every block the group commits to s1 equals, byte for byte, the block p2 commits to s2;
  - a prompt extending a cached one reuses its prefix on every stage and still matches byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mooncaked.config import Config
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import (DECODE, PREFILL, RESERVE, DecodeRequest, PrefillReply, PrefillRequest,
                                             ReserveRequest, SamplingSpec)
from mooncaked.roles.worker.prefill.role import PrefillRole
from mooncaked.runtime.lifecycle import Role
from mooncaked.store.client import StoreClient
from mooncaked.store.shm_pool import pool_path
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from mooncaked.model.grammar import grammar_for
from tests.model.sampling_reference import reference_adjust
from tests.roles.engine_reference import greedy_tokens

GREEDY = SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True)
NAMES = ["s1", "s2", "g0", "g1", "p2", "d1"]


def group_config(tmp_path: Path, chunk_tokens: int, **worker: Any) -> Config:
    return cluster_config(tmp_path, [
        instance("s1", "store", "127.0.0.1"), instance("g0", "prefill", "127.0.0.1"),
        instance("g1", "prefill", "127.0.0.1"), instance("d1", "decode", "127.0.0.1"),
        instance("s2", "store", "127.0.0.2"),
        instance("p2", "prefill", "127.0.0.2", settings={"prefill_chunk": chunk_tokens})],
        cluster={"prefill_groups": [{"name": "pg", "members": ["g0", "g1"]}]},
        worker={"cpp_chunk_tokens": chunk_tokens, "profile_s": 0, **worker})


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def keys_for(config: Config, tokens: list[int]) -> list[bytes]:
    loaded = load_model(config.model.source, dtype=config.model.dtype, seed=config.model.seed)
    namespace = model_namespace(loaded.model_id, config.model.dtype, config.kv.block_size,
                                loaded.args.kv_geometry)
    return block_keys(tokens, config.kv.block_size, namespace)


async def prefill(clients: PeerClients, config: Config, name: str, request_id: str, tokens: list[int],
                  **extra: Any) -> PrefillReply:
    client = clients.for_instance(config.instance_named(name))
    request = PrefillRequest(request_id, tokens, keys_for(config, tokens), GREEDY, **extra)
    reply: PrefillReply = await client.call(PREFILL, request, timeout_s=30)
    return reply


async def stored_blocks(clients: PeerClients, config: Config, store: str, keys: list[bytes]) -> list[bytes]:
    """The bytes of every committed block of `keys` in `store` (read through its shared-memory pool)."""
    instance_config = config.instance_named(store)
    client = await StoreClient.connect(clients.for_instance(instance_config), host=instance_config.host,
                                       pool_path=pool_path(config.cluster.id, store, config.store.shm_dir))
    try:
        found = await client.lookup(keys, lease_ms=10_000)
        assert client.pool is not None
        block_bytes = len(client.pool.array) and _object_bytes(config)
        blocks = [bytes(client.pool.array[loc.offset: loc.offset + block_bytes]) for loc in found.locations]
        if found.read_lease_id:
            await client.release([found.read_lease_id])
        return blocks
    finally:
        await client.close()


def _object_bytes(config: Config) -> int:
    args = load_model(config.model.source).args
    return args.num_layers * 2 * config.kv.block_size * args.num_kv_heads * args.head_dim * 4


@contextlib.asynccontextmanager
async def cluster(config: Config) -> AsyncIterator[tuple[dict[str, Role], PeerClients]]:
    async with running_roles(config, NAMES) as roles:
        clients = PeerClients(config, config.instance_named("g0"))
        try:
            yield roles, clients
        finally:
            await clients.close()


def assert_nothing_held(roles: dict[str, Role]) -> None:
    for name in ("g0", "g1", "p2"):
        role = roles[name]
        assert isinstance(role, PrefillRole)
        pages = role.worker.pages
        assert pages is not None and pages.num_free == pages.num_pages, name
        assert role.is_idle, name
        assert role.stage_service is None or not role.stage_service.jobs


@pytest.mark.parametrize("chunk_tokens", [16, 24, 40, 64])
async def test_a_group_prefills_like_a_single_instance_byte_for_byte(tmp_path: Path, chunk_tokens: int) -> None:
    """96 tokens = 6 blocks: chunks of 16 and 24 divide the prompt, 40 and 64 do not."""
    config = group_config(tmp_path, chunk_tokens)
    tokens = prompt(chunk_tokens, 96)
    keys = keys_for(config, tokens)
    expected = greedy_tokens(load_model("random:tiny"), tokens, 1)
    async with cluster(config) as (roles, clients):
        group = await prefill(clients, config, "g0", "r-group", tokens)
        single = await prefill(clients, config, "p2", "r-single", tokens)
        assert group.first_token.token_id == single.first_token.token_id == expected[0]
        assert group.num_cached_tokens == single.num_cached_tokens == 0
        in_group_store = await stored_blocks(clients, config, "s1", keys)
        in_single_store = await stored_blocks(clients, config, "s2", keys)
        assert len(in_group_store) == len(in_single_store) == 6
        assert in_group_store == in_single_store
        assert_nothing_held(roles)
        stage1 = roles["g1"]
        assert isinstance(stage1, PrefillRole) and stage1.worker.perf.num_samples()["prefill_live"] == 1
        assert stage1.worker.loaded is not None and len(stage1.worker.loaded.model.layers) == 1


async def test_a_cached_prefix_is_loaded_by_every_stage(tmp_path: Path) -> None:
    config = group_config(tmp_path, 24)
    first = prompt(1, 70)
    longer = first[:64] + prompt(2, 50)  # shares 4 blocks with `first`
    expected = greedy_tokens(load_model("random:tiny"), longer, 1)
    async with cluster(config) as (roles, clients):
        await prefill(clients, config, "g0", "a-group", first)
        await prefill(clients, config, "p2", "a-single", first)
        group = await prefill(clients, config, "g0", "b-group", longer)
        single = await prefill(clients, config, "p2", "b-single", longer)
        assert group.num_cached_tokens == single.num_cached_tokens == 64
        assert group.first_token.token_id == single.first_token.token_id == expected[0]
        keys = keys_for(config, longer)
        assert await stored_blocks(clients, config, "s1", keys) == await stored_blocks(clients, config, "s2", keys)
        assert_nothing_held(roles)


async def test_greedy_decode_after_a_group_prefill_equals_the_reference(tmp_path: Path) -> None:
    config = group_config(tmp_path, 16)
    tokens = prompt(5, 53)  # a partial tail block: the decode host gets it from both stages too
    expected = greedy_tokens(load_model("random:tiny"), tokens, 8)
    spec = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with cluster(config) as (roles, clients):
        decode = clients.for_instance(config.instance_named("d1"))
        keys = keys_for(config, tokens)
        reserve = await decode.call(RESERVE, ReserveRequest("r1", keys, len(tokens), 8, 10_000), timeout_s=10)
        assert reserve.is_accepted, reserve.reason
        reply = await prefill(clients, config, "g0", "r1", tokens, decode_store=reserve.store_instance,
                              destinations=reserve.destinations)
        out = [reply.first_token.token_id]
        async for item in decode.stream(DECODE, DecodeRequest("r1", tokens, keys, spec, reply.first_token),
                                        timeout_s=30):
            out.extend(t.token_id for t in item.tokens)
        assert out == expected
        assert_nothing_held(roles)


async def test_the_last_stage_samples_with_penalties_over_the_request_history(tmp_path: Path) -> None:
    """A migrated leg's prompt ends with the output streamed before it: the last stage, which alone samples, gets the
    token ids and counts that output (frequency, presence) and the whole history (repetition) like one instance."""
    config = group_config(tmp_path, 24)
    tokens = prompt(9, 60)
    num_output = 12
    spec = SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True, num_sampled=num_output,
                        frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.5)

    def adjust(row: list[float], output: list[int]) -> list[float]:
        return reference_adjust(row, prompt=tokens[:-num_output], output=tokens[-num_output:] + output,
                                repetition_penalty=1.5, frequency_penalty=2.0, presence_penalty=1.0)

    expected = greedy_tokens(load_model("random:tiny"), tokens, 1, adjust=adjust)
    async with cluster(config) as (roles, clients):
        replies = [await clients.for_instance(config.instance_named(name)).call(
            PREFILL, PrefillRequest(f"r-{name}", tokens, keys_for(config, tokens), spec), timeout_s=30)
            for name in ("g0", "p2")]
        assert [reply.first_token.token_id for reply in replies] == expected * 2
        assert_nothing_held(roles)


async def test_the_last_stage_samples_under_the_request_grammar(tmp_path: Path) -> None:
    """A migrated leg under a grammar: the last stage rebuilds it from the output in the prompt's tail."""
    config = group_config(tmp_path, 24)
    tokenizer = load_model("random:tiny").tokenizer
    choices = ["alpha-7", "alps-2", "beta"]
    tokens = prompt(4, 50) + tokenizer.encode("alp", add_special_tokens=False)
    spec = SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True, num_sampled=3,
                        grammar=grammar_for("choice", json.dumps(choices)))
    allowed = {tokenizer.encode(text, add_special_tokens=False)[0] for text in ("h", "s")}
    async with cluster(config) as (roles, clients):
        replies = [await clients.for_instance(config.instance_named(name)).call(
            PREFILL, PrefillRequest(f"r-{name}", tokens, keys_for(config, tokens), spec), timeout_s=30)
            for name in ("g0", "p2")]
        assert replies[0].first_token.token_id == replies[1].first_token.token_id
        assert replies[0].first_token.token_id in allowed
        assert_nothing_held(roles)


async def test_prefill_sent_to_a_later_stage_names_the_first(tmp_path: Path) -> None:
    from mooncaked.rpc import InvalidArgument

    config = group_config(tmp_path, 16)
    async with cluster(config) as (_, clients):
        with pytest.raises(InvalidArgument, match="send PREFILL to its first stage g0"):
            await prefill(clients, config, "g1", "r1", prompt(3, 20))
