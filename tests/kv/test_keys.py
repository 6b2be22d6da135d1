"""Block keys: chained, namespaced, full blocks only, deterministic."""

from __future__ import annotations

import pytest

from mooncaked.kv.keys import KEY_BYTES, block_keys, model_namespace

NS = model_namespace("smollm2-135m", "float32", 4, "2x2x2x16")


def test_only_full_blocks_get_keys() -> None:
    assert len(block_keys(list(range(11)), 4, NS)) == 2
    assert block_keys([1, 2, 3], 4, NS) == []
    assert all(len(k) == KEY_BYTES for k in block_keys(list(range(8)), 4, NS))


def test_keys_chain_on_the_prefix() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    c = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4, NS)
    assert c[:2] == a  # a shared prefix gives shared keys


def test_namespace_separates_models_dtypes_block_sizes_and_kv_geometries() -> None:
    tokens = list(range(8))
    namespaces = [model_namespace("m1", "float32", 4, "2x2x2x16"), model_namespace("m2", "float32", 4, "2x2x2x16"),
                  model_namespace("m1", "bfloat16", 4, "2x2x2x16"),
                  model_namespace("m1", "float32", 4, "2x1x1x40")]  # an MLA latent under the same model id
    keys = {block_keys(tokens, 4, ns)[0] for ns in namespaces}
    assert len(keys) == 4
    assert model_namespace("m1", "float32", 4, "2x2x2x16") != model_namespace("m1", "float32", 8, "2x2x2x16")


def test_deterministic_known_value() -> None:
    key = block_keys(list(range(64)), 64, model_namespace("m", "float32", 64, "2x2x2x16"))[0]
    assert key == block_keys(list(range(64)), 64, model_namespace("m", "float32", 64, "2x2x2x16"))[0]
    assert key.hex() == "eb881f08bd5539ac5d743b17e9c3aca1"  # the namespace folds in the KV geometry


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        block_keys([1], 0, NS)
    with pytest.raises(OverflowError):
        block_keys([-1, 2, 3, 4], 4, NS)


def test_isolation_tags_separate_tenants_and_salts_and_the_empty_tag_shares() -> None:
    from mooncaked.kv.keys import isolated_namespace, isolation_tag

    namespace = model_namespace("m", "float32", 16, "2x2x2x16")
    assert isolation_tag() == b"" and isolated_namespace(namespace, b"") == namespace
    tags = {isolation_tag(tenant="a"), isolation_tag(tenant="b"), isolation_tag(cache_salt="a"),
            isolation_tag(tenant="a", cache_salt="x"), isolation_tag(tenant="a", cache_salt="y"),
            isolation_tag(tenant="a\x00salt=x")}
    assert len(tags) == 6 and all(len(t) == 16 for t in tags)
    spaces = {isolated_namespace(namespace, t) for t in tags}
    assert len(spaces) == 6 and namespace not in spaces
    tokens = list(range(64))
    assert block_keys(tokens, 16, isolated_namespace(namespace, isolation_tag(cache_salt="a"))) != \
        block_keys(tokens, 16, namespace)
