"""int8 KV on running roles: store objects and transfers hold the compressed form (a prefix read back from the
store gives the same first token as computing it), and an instance refuses block keys of another cache_dtype, so
a compressed and an uncompressed instance never share a block."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mooncaked.kv.cache_dtype import namespace_dtype
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import PREFILL, PrefillRequest, SamplingSpec
from mooncaked.rpc import InvalidArgument, RpcClient
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles


async def test_int8_objects_round_trip_through_the_store_and_other_dtypes_keys_are_refused(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill")],
                            kv={"block_size": 16, "cache_dtype": "int8", "device_prefix_cache": False})
    loaded = load_model(config.model.source, dtype=config.model.dtype, seed=config.model.seed)
    args = loaded.args

    def keys(cache_dtype: str, tokens: list[int]) -> list[bytes]:
        namespace = model_namespace(loaded.model_id, namespace_dtype(config.model.dtype, cache_dtype), 16,
                                    args.kv_geometry)
        return block_keys(tokens, 16, namespace)

    tokens = [random.Random(3).randrange(3, 300) for _ in range(70)]
    spec = SamplingSpec(max_tokens=1, temperature=0.0)
    async with running_roles(config, ["s0", "p0"]) as roles:
        worker = roles["p0"].worker  # type: ignore[attr-defined]
        # one object: every layer's K and V rows of 16 tokens, head_dim int8 values + a 2-byte scale each
        assert worker.block_nbytes == args.num_layers * 2 * 16 * args.num_kv_heads * (args.kv_head_dim + 2)
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            prefill: RpcClient = clients.for_instance(config.instance_named("p0"))
            computed = await prefill.call(PREFILL, PrefillRequest("r1", tokens, keys("int8", tokens), spec),
                                          timeout_s=30)
            assert computed.num_cached_tokens == 0
            reused = await prefill.call(PREFILL, PrefillRequest("r2", tokens, keys("int8", tokens), spec),
                                        timeout_s=30)
            assert reused.num_cached_tokens == 64  # 4 int8 blocks read back from the store
            assert reused.first_token.token_id == computed.first_token.token_id
            with pytest.raises(InvalidArgument, match="namespace"):
                await prefill.call(PREFILL, PrefillRequest("r3", tokens, keys("auto", tokens), spec), timeout_s=30)
        finally:
            await clients.close()
    assert len({keys(cache_dtype, tokens)[0] for cache_dtype in ("auto", "int8", "fp8_e4m3")}) == 3
