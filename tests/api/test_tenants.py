"""Tenants files (every field checked, errors naming line and field, hostile files generated), key lookup, and
the per-tenant limits on a virtual clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.api.limits import TenantLimits
from mooncaked.api.tenants import Tenant, TenantsError, from_api_keys, load_tenants

GOOD = """\
tenants:
  - id: team-a
    api_keys: [key-a1, key-a2]
    kv: private
    pool_share: 0.4
    min_pool_share: 0.1
    requests_per_s: 10
    max_concurrent: 32
  - id: team-b
    api_keys: [key-b]
    kv: shared
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return path


def test_a_good_file_gives_every_tenant_and_finds_them_by_key(tmp_path: Path) -> None:
    directory = load_tenants(write(tmp_path, GOOD))
    a, b = directory.tenants["team-a"], directory.tenants["team-b"]
    assert (a.kv, a.pool_share, a.min_pool_share, a.requests_per_s, a.max_concurrent) == ("private", 0.4, 0.1, 10.0, 32)
    assert (b.kv, b.pool_share, b.requests_per_s, b.max_concurrent) == ("shared", None, None, None)
    assert directory.identify("key-a2") is a and directory.identify("key-b") is b
    assert directory.identify("key-a") is None and directory.identify("") is None
    assert "key-a1" not in repr(a)  # keys never show up in logs
    assert from_api_keys([]).is_open and not from_api_keys(["k"]).is_open
    assert from_api_keys(["k"]).identify("k") == Tenant("default", ("k",), kv="shared")


@pytest.mark.parametrize(("text", "expected"), [
    ("tenants: []\n", "line 1: tenants: expected a non-empty list"),
    ("teams: []\n", "line 1: the file must be a mapping with one key, `tenants`"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n    pool_shar: 0.5\n", "line 4: 'pool_shar' is not a tenant field"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n    kv: open\n", "line 4: kv: 'open': use private or shared"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n    pool_share: 1.5\n", "line 4: pool_share: must be a number in (0, 1]"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n    requests_per_s: -1\n", "line 4: requests_per_s: must be a number > 0"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n    max_concurrent: 0\n", "line 4: max_concurrent: must be at least 1"),
    ("tenants:\n  - id: a b\n    api_keys: [k]\n", "line 2: id: 'a b': use 1-64 of"),
    ("tenants:\n  - id: a\n    api_keys: []\n", "line 3: api_keys: expected a non-empty list"),
    ("tenants:\n  - id: a\n", "line 2: a tenant needs an id and api_keys"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n  - id: a\n    api_keys: [j]\n", "line 4: id: 'a' names two tenants"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n  - id: b\n    api_keys: [k]\n", "line 4: api_keys: tenant b reuses"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n    pool_share: 0.1\n    min_pool_share: 0.2\n",
     "line 2: tenant a: min_pool_share 0.2 is above its pool_share 0.1"),
    ("tenants:\n  - id: a\n    api_keys: [k]\n    max_concurrent: 2.5\n", "line 4: max_concurrent: expected a int"),
    ("tenants: [\n", "not valid YAML"),
])
def test_errors_name_the_line_and_the_field(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(TenantsError) as error:
        load_tenants(write(tmp_path, text))
    message = str(error.value).replace(f"{tmp_path / 'tenants.yaml'}:", "line ")
    assert expected in message, message


yaml_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=3),
                           max_leaves=10)
fields = st.sampled_from(["id", "api_keys", "kv", "pool_share", "min_pool_share", "requests_per_s",
                          "max_concurrent", "other"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(fields, yaml_values, max_size=6), max_size=4) | yaml_values)
def test_hostile_files_give_a_clear_error_or_valid_tenants(tmp_path_factory: pytest.TempPathFactory,
                                                           tenants: object) -> None:
    path = tmp_path_factory.mktemp("t") / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants}, allow_unicode=True))
    try:
        directory = load_tenants(path)
    except TenantsError as exc:
        assert str(path) in str(exc)
        return
    assert directory.tenants and all(t.api_keys for t in directory.tenants.values())


def test_a_rate_limit_admits_a_burst_then_one_request_per_interval() -> None:
    limits = TenantLimits({"a": Tenant("a", ("k",), requests_per_s=2.0), "b": Tenant("b", ("j",))})
    assert limits.try_admit("a", 0.0) is None and limits.try_admit("a", 0.0) is None  # a burst of 2
    assert limits.try_admit("a", 0.0) == pytest.approx(0.5)  # the next token in half a second
    assert limits.try_admit("a", 0.5) is None
    assert all(limits.try_admit("b", 0.0) is None for _ in range(100))  # b has no limits: a's excess is a's


def test_a_concurrency_cap_holds_until_a_slot_is_released_and_a_reload_keeps_buckets() -> None:
    tenant = Tenant("a", ("k",), max_concurrent=2)
    limits = TenantLimits({"a": tenant})
    assert limits.try_admit("a", 0.0) is None and limits.try_admit("a", 0.0) is None
    assert limits.try_admit("a", 0.0) == 1.0
    limits.release("a")
    assert limits.try_admit("a", 1.0) is None
    limits.update({"a": tenant})
    assert limits.try_admit("a", 1.0) == 1.0  # still two in flight after the reload
    limits.update({})
    assert limits.try_admit("a", 1.0) is None  # a tenant that left is not limited here (its key no longer works)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3),
                           max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_cache_salt_is_either_used_or_a_clear_400(salt: object) -> None:
    from mooncaked.api.errors import ApiError
    from mooncaked.api.requests import parse_completion_request

    try:
        request = parse_completion_request({"prompt": "hi", "cache_salt": salt}, request_id="r", model_ids=["m"])
    except ApiError as error:
        assert error.status == 400 and error.param == "cache_salt"
        return
    assert request.cache_salt == salt or salt is None
