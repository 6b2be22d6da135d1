"""Member records, the member table's diffs and the static membership (no etcd needed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hypothesis import given, strategies as st

from mooncaked.cluster.membership import MemberRecord, MemberTable, StaticMembership, store_on_host
from mooncaked.config import load_config
from mooncaked.roles.member import make_membership
import pytest

CONFIG = {
    "cluster": {"id": "c1", "instances": [
        {"name": "s0", "role": "store", "host": "127.0.0.2", "port": 7000, "data_port": 7001},
        {"name": "p0", "role": "prefill", "host": "127.0.0.2", "port": 7002, "settings": {"switchable": True}},
        {"name": "d0", "role": "decode", "host": "127.0.0.3", "port": 7003},
        {"name": "c0", "role": "conductor", "host": "127.0.0.3", "port": 8000}]},
}


def config(tmp_path: Path, **cluster: object):
    import yaml

    data = json.loads(json.dumps(CONFIG))
    data["cluster"].update(cluster)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_record_round_trip_and_instance_config(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    record = MemberRecord.for_instance(cfg, cfg.instance_named("p0"), "starting")
    assert record.is_switchable and record.settings["max_batch_size"] == cfg.worker.max_batch_size
    assert "num_kv_pages" not in record.settings  # sized from the memory budget: the worker's LOAD replies tell it
    assert MemberRecord.from_json(record.to_json()) == record
    pinned = config(tmp_path, instances=[{**CONFIG["cluster"]["instances"][1], "settings": {"num_kv_pages": 99}}])
    assert MemberRecord.for_instance(pinned, pinned.instances_of("prefill")[0], "ready").settings["num_kv_pages"] == 99
    instance = record.instance_config()
    assert (instance.name, instance.role, instance.host, instance.port) == ("p0", "prefill", "127.0.0.2", 7002)
    assert cfg.role_section(instance).max_batch_size == cfg.worker.max_batch_size


@given(st.one_of(st.binary(max_size=64), st.dictionaries(st.text(max_size=8), st.one_of(
    st.none(), st.integers(), st.text(max_size=8), st.booleans(), st.lists(st.integers(), max_size=2)), max_size=6)))
def test_hostile_records_raise_value_error(data: object) -> None:
    raw = data if isinstance(data, bytes) else json.dumps({"version": 1, **data}).encode()  # type: ignore[dict-item]
    try:
        record = MemberRecord.from_json(raw)
    except ValueError as exc:
        assert str(exc)
    else:
        record.check()


@given(st.sampled_from(["name", "role", "host", "port", "state", "settings", "is_switchable", "incarnation"]),
       st.one_of(st.none(), st.integers(-5, 70000), st.text(max_size=5), st.booleans(), st.dictionaries(
           st.text(max_size=4), st.integers(-2, 3), max_size=2)))
def test_one_bad_field_is_named(field_name: str, value: object) -> None:
    good = MemberRecord("p0", "prefill", "h", 1, settings={"num_kv_pages": 3})
    raw = json.loads(good.to_json())
    raw[field_name] = value
    try:
        record = MemberRecord.from_json(json.dumps(raw).encode())
    except ValueError as exc:
        assert "member record" in str(exc)
    else:
        record.check()


def test_table_reports_joins_changes_and_leaves() -> None:
    table = MemberTable()
    seen: list[tuple[str, str | None, str | None]] = []
    table.add_listener(lambda n, old, new: seen.append((n, old and old.state, new and new.state)))
    a = MemberRecord("a", "decode", "h", 1)
    table.replace_all({"a": a, "b": MemberRecord("b", "store", "h", 2)})
    table.apply("a", dataclasses.replace(a, state="draining"))
    table.apply("a", dataclasses.replace(a, state="draining"))  # no change: no call
    table.replace_all({"a": dataclasses.replace(a, state="draining")})
    assert seen == [("a", None, "ready"), ("b", None, "ready"), ("a", "ready", "draining"), ("b", "ready", None)]


def test_a_failing_listener_does_not_stop_the_others() -> None:
    table = MemberTable()
    seen: list[str] = []

    def broken(name: str, old: object, new: object) -> None:
        raise RuntimeError("boom")

    table.add_listener(broken)
    table.add_listener(lambda n, old, new: seen.append(n))
    table.apply("a", MemberRecord("a", "decode", "h", 1))
    assert seen == ["a"]


async def test_static_membership(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    membership = make_membership(cfg, cfg.instance_named("d0"))
    assert isinstance(membership, StaticMembership)
    await membership.start()
    assert set(membership.members()) == {"s0", "p0", "d0", "c0"}
    assert all(r.is_ready for r in membership.members().values())
    store = store_on_host(membership, "127.0.0.2")
    assert store is not None and store.name == "s0" and store_on_host(membership, "127.0.0.3") is None
    changes: list[str] = []
    membership.add_listener(lambda n, old, new: changes.append(f"{n}:{new.state if new else None}"))
    await membership.set_state("draining")
    assert changes == ["d0:draining"] and membership.status().is_connected
    await membership.stop()


@pytest.mark.parametrize("override, message", [
    ({"membership": "etcd", "etcd": {"endpoints": []}}, "cluster.etcd.endpoints: needs at least one"),
    ({"membership": "etcd", "etcd": {"endpoints": ["127.0.0.1:2379"]}}, "expected http://host:port"),
    ({"membership": "etcd", "etcd": {"endpoints": ["http://h:0"]}}, "port must be 1-65535"),
    ({"membership": "etcd", "etcd": {"prefix": "x/"}}, "cluster.etcd.prefix: must start with '/'"),
    ({"membership": "etcd", "id": "a/b"}, "cluster.id: must be non-empty without '/'"),
    ({"membership": "etcdd"}, "did you mean 'etcd'"),
    ({"etcd": {"min_backoff_s": 9.0, "max_backoff_s": 1.0}}, "must not exceed cluster.etcd.max_backoff_s"),
])
def test_bad_membership_config_is_named(tmp_path: Path, override: dict[str, object], message: str) -> None:
    from mooncaked.config import ConfigError

    with pytest.raises(ConfigError) as excinfo:
        config(tmp_path, **override)
    assert message in str(excinfo.value)


def test_switch_messages_round_trip() -> None:
    from mooncaked.roles.worker.switch_messages import SWITCH, SwitchReply, SwitchRequest
    from mooncaked.rpc.protocol import decode_message, encode_message

    for message in (SwitchRequest("decode", "move_prefill_to_decode", 12.5),
                    SwitchReply("decode", True, "", 0.25, 1, 3), SwitchReply("prefill", False, "already prefill")):
        assert decode_message(type(message), encode_message(message)) == message
    assert (SWITCH.request, SWITCH.response, SWITCH.is_streaming) == (SwitchRequest, SwitchReply, False)
