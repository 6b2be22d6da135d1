"""Tenant shares of a store: the pure policy, and the store core evicting by it."""

from __future__ import annotations

import pytest

from mooncaked.kv.store_core import StoreCore, StoreFull
from mooncaked.kv.store_types import StoreConfig
from mooncaked.kv.tenant_quota import TenantShare, TenantUsage

BLOCK = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_over_its_share_a_writer_may_evict_only_its_own_blocks() -> None:
    usage = TenantUsage()
    usage.state("a", TenantShare(pool_share=0.5))
    usage.state("b", TenantShare(min_pool_share=0.2))
    usage.add("a", "dram", 50)
    usage.add("b", "dram", 20)
    assert usage.is_over_share("a", 1, capacity=100) and not usage.is_over_share("a", 0, capacity=100)
    mine_only = usage.may_evict("a", 1, capacity=100)
    assert mine_only("a") and not mine_only("b") and not mine_only("")
    assert usage.is_protected("b", capacity=100)  # 20 bytes <= 0.2 x 100: other tenants may not take them
    anyone_but_b = usage.may_evict("c", 1, capacity=100)
    assert anyone_but_b("a") and anyone_but_b("") and not anyone_but_b("b")
    usage.add("b", "dram", 1)
    assert usage.may_evict("c", 1, capacity=100)("b")  # above its floor now
    usage.add("a", "dram", -50)
    assert "a" not in usage.dram_bytes
    with pytest.raises(ValueError):
        TenantShare(pool_share=1.5)


def core(num_blocks: int) -> StoreCore:
    return StoreCore(StoreConfig(capacity_bytes=num_blocks * BLOCK, alignment=BLOCK))


def write(store: StoreCore, keys: list[int], tenant: str, share: TenantShare, now: float) -> None:
    grants, _, _ = store.allocate([key(i) for i in keys], BLOCK, 10_000, now, tenant=tenant, share=share)
    store.commit([g.handle_id for g in grants], now)


def test_a_flooding_tenant_evicts_itself_and_never_below_anothers_floor() -> None:
    store = core(10)
    greedy, guarded = TenantShare(pool_share=0.5), TenantShare(min_pool_share=0.2)
    write(store, [100, 101], "b", guarded, now=0.0)  # b's warm prefix: 2 blocks, its floor
    for i in range(20):  # a writes far more than its half
        write(store, [i], "a", greedy, now=1.0 + i)
    assert store.tenants.dram_bytes == {"a": 5 * BLOCK, "b": 2 * BLOCK}
    assert store.location(key(100)) is not None and store.location(key(101)) is not None
    assert store.location(key(19)) is not None and store.location(key(14)) is None  # its own oldest went first
    write(store, [200, 201, 202], "c", TenantShare(), now=30.0)  # a third tenant takes a's space, not b's
    assert store.tenants.dram_bytes["b"] == 2 * BLOCK and store.tenants.dram_bytes["c"] == 3 * BLOCK


def test_a_tenant_at_its_share_with_nothing_evictable_is_refused_by_name() -> None:
    store = core(10)
    share = TenantShare(pool_share=0.2)
    grants, _, _ = store.allocate([key(1), key(2)], BLOCK, 10_000, 0.0, tenant="a", share=share)
    store.commit([g.handle_id for g in grants], 0.0)
    store.pin([key(1), key(2)], ttl_ms=60_000, now=0.0)
    with pytest.raises(StoreFull, match="tenant a is at its pool_share"):
        store.allocate([key(3)], BLOCK, 10_000, 1.0, tenant="a", share=share)
    write(store, [4], "", TenantShare(), now=2.0)  # no tenant: no share applies
