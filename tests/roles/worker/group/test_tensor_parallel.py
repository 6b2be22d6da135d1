"""Prefill group stages with tensor-parallel ranks (tiny model: 4 query, 2 KV heads; one layer per stage): a
stage's ranks hold its layers' shard and take the previous stage's hidden states with the batch; the group
commits the blocks a single TP=1 instance commits (up to the all-reduce's summation order) and its first token,
and a later prompt reuses the prefix on every stage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mooncaked.config import Config
from mooncaked.model.loader import load_model
from mooncaked.roles.worker.prefill.role import PrefillRole
from tests.roles.cluster_fixtures import cluster_config, instance
from tests.roles.engine_reference import greedy_tokens
from tests.roles.worker.group.test_pipeline import (assert_nothing_held, cluster, keys_for, prefill, prompt,
                                                    stored_blocks)

TP2 = {"tensor_parallel_size": 2}


def assert_same_kv(blocks: list[bytes], expected: list[bytes]) -> None:
    """Every block's fp32 KV equal to the TP=1 instance's up to the ranks' all-reduce order."""
    assert len(blocks) == len(expected) > 0
    for block, reference in zip(blocks, expected):
        np.testing.assert_allclose(np.frombuffer(block, np.float32), np.frombuffer(reference, np.float32),
                                   rtol=0, atol=1e-5)


def tp_group_config(tmp_path: Path, chunk_tokens: int, first: dict[str, int], second: dict[str, int]) -> Config:
    """The group g0 + g1 of test_cpp_pipeline with each stage's own ranks; p2 a single TP=1 instance."""
    return cluster_config(tmp_path, [
        instance("s1", "store", "127.0.0.1"), instance("g0", "prefill", "127.0.0.1", settings=first),
        instance("g1", "prefill", "127.0.0.1", settings=second), instance("d1", "decode", "127.0.0.1"),
        instance("s2", "store", "127.0.0.2"),
        instance("p2", "prefill", "127.0.0.2", settings={"prefill_chunk": chunk_tokens})],
        cluster={"prefill_groups": [{"name": "pg", "members": ["g0", "g1"]}]},
        worker={"cpp_chunk_tokens": chunk_tokens, "profile_s": 0})


# one tensor-parallel group per process (model.tensor_parallel), and these roles share the test's process
@pytest.mark.parametrize(("first", "second"), [(TP2, {}), ({}, TP2)])
async def test_stages_with_ranks_prefill_like_a_single_instance(
        tmp_path: Path, first: dict[str, int], second: dict[str, int]) -> None:
    config = tp_group_config(tmp_path, 24, first, second)
    tokens, longer = prompt(7, 70), prompt(7, 70)[:64] + prompt(8, 30)  # 70 tokens: chunks of 24, 24, 22
    expected = greedy_tokens(load_model("random:tiny"), longer, 1)
    async with cluster(config) as (roles, clients):
        ranks = {name: roles[name].worker.tp is not None for name in ("g0", "g1")}  # type: ignore[attr-defined]
        for request_id, prompt_tokens in (("a", tokens), ("b", longer)):
            group = await prefill(clients, config, "g0", f"{request_id}-group", prompt_tokens)
            single = await prefill(clients, config, "p2", f"{request_id}-single", prompt_tokens)
            assert group.first_token.token_id == single.first_token.token_id
            assert group.num_cached_tokens == single.num_cached_tokens == (0 if request_id == "a" else 64)
            keys = keys_for(config, prompt_tokens)
            assert_same_kv(await stored_blocks(clients, config, "s1", keys),
                           await stored_blocks(clients, config, "s2", keys))
        assert group.first_token.token_id == expected[0]
        assert_nothing_held(roles)
        second_stage = roles["g1"]
        assert isinstance(second_stage, PrefillRole) and second_stage.worker.kv_pages is not None
        assert second_stage.worker.kv_pages.first_layer == 1 and second_stage.worker.kv_pages.num_layers == 1
    assert ranks == {"g0": first == TP2, "g1": second == TP2}
