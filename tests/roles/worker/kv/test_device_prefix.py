"""The device prefix cache on running roles: a repeated conversation reads its prefix from the instance's own
pages (the device tier's metric counts it; on the decode instance its earlier answers' blocks too), the greedy
tokens are the same with the tier on and off, and a request under another cache_salt never reads a block cached
for the shared namespace."""

from __future__ import annotations

import random
from pathlib import Path

from mooncaked.kv.keys import block_keys, isolated_namespace, isolation_tag, model_namespace
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.runtime.lifecycle import Role
from mooncaked.roles.worker.messages import LOAD, PREFILL, LoadRequest, PrefillRequest, SamplingSpec
from mooncaked.rpc import RpcClient
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.engine_reference import greedy_tokens
from tests.roles.test_disagg_roles import generate, keys_for


def device_blocks(role: Role) -> float:
    value = role.metrics.registry.get_sample_value("mooncaked_device_prefix_blocks_total")  # type: ignore[attr-defined]
    return 0.0 if value is None else value


async def conversation(tmp_path: Path, is_cached: bool) -> tuple[list[list[int]], dict[str, float]]:
    """Three turns, each prompt the previous prompt, its answer and a new user message; then the first turn's
    prompt under another cache_salt."""
    tmp_path.mkdir()
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")],
                            kv={"block_size": 16, "device_prefix_cache": is_cached})
    rng = random.Random(5)
    prompt = [rng.randrange(3, 300) for _ in range(40)]
    outputs: list[list[int]] = []
    async with running_roles(config, ["s0", "p0", "d0"]) as roles:
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            for turn in range(3):
                out, _ = await generate(config, clients, f"turn{turn}", prompt, 12, inline=turn == 2)
                outputs.append(out)
                prompt = prompt + out + [rng.randrange(3, 300) for _ in range(20)]
            counts = {name: device_blocks(roles[name]) for name in ("p0", "d0")}
            pages = roles["d0"].worker.pages  # type: ignore[attr-defined]
            # every request ended: the cached pages are free for admission and reservations (no 429 from them);
            # d0 holds turn 2's 104 prompt and 11 output tokens' KV: 7 full blocks
            assert pages.num_free == pages.num_pages and pages.num_cached == (7 if is_cached else 0)
            first = prompt[:40]
            tag = isolation_tag(cache_salt="other")
            loaded = load_model(config.model.source, dtype=config.model.dtype, seed=config.model.seed)
            namespace = model_namespace(loaded.model_id, config.model.dtype, 16, loaded.args.kv_geometry)
            keys = block_keys(first, 16, isolated_namespace(namespace, tag))
            prefill: RpcClient = clients.for_instance(config.instance_named("p0"))
            reply = await prefill.call(PREFILL, PrefillRequest("salted", first, keys, SamplingSpec(max_tokens=1),
                                                               key_isolation=tag), timeout_s=30)
            assert reply.num_cached_tokens == 0  # neither the device tier nor the store shares across salts
            counts["p0 salted"] = device_blocks(roles["p0"]) - counts["p0"]
            assert keys_for(config, first)[0] != keys[0]
            dump = await prefill.call(LOAD, LoadRequest(device_cache_seq=-1), timeout_s=10)
            if is_cached:  # what the conductor's device index learns: the turns' and the salted prompt's blocks
                assert dump.is_device_cache_dump
                assert set(dump.device_keys_gained) == {*keys_for(config, prompt[:72])[:4], *keys}
                again = await prefill.call(LOAD, LoadRequest(device_cache_seq=dump.device_cache_seq), timeout_s=10)
                assert not again.is_device_cache_dump and again.device_keys_gained == again.device_keys_lost == []
            else:
                assert not dump.is_device_cache_dump and dump.device_keys_gained == []
        finally:
            await clients.close()
    return outputs, counts


async def test_a_repeated_conversation_hits_the_device_tier_with_the_same_greedy_tokens(tmp_path: Path) -> None:
    cached, counts = await conversation(tmp_path / "on", is_cached=True)
    uncached, counts_off = await conversation(tmp_path / "off", is_cached=False)
    assert cached == uncached
    rng = random.Random(5)
    prompt = [rng.randrange(3, 300) for _ in range(40)]
    assert cached[0] == greedy_tokens(load_model("random:tiny"), prompt, 12)
    # turn 0: 40 prompt tokens, 12 out; turn 1: those and 20 more, 72 (4 full blocks); turn 2: 104 (6), inline.
    # p0 reads turn 0's 2 prompt blocks for turn 1. d0 reads 3 for turn 1: turn 0's 2 prompt blocks and the one
    # its answer filled (40 + 11 decoded tokens hold 3 blocks); for turn 2, 5 of turn 1's 72 + 11
    assert counts["p0"] == 2 and counts["d0"] == 3 + 5
    assert counts["p0 salted"] == 0
    assert counts_off == {"p0": 0, "d0": 0, "p0 salted": 0}
