"""Where one prompt's KV comes from and goes to on a worker, planned before its forward.

1. `plan_prompt_kv(...)` checks the block keys and reads the longest prefix the instance's device prefix cache
   holds in place (RequestKv; the device tier); when told to fetch a prefix from another host's store it looks
   the blocks up there (leased, not copied yet); it allocates this host's store space for every block it lacks
   (read leases on the present ones: the reusable prefix is this host's blocks, then the other host's), and
   starts loading the rest of the prefix (past the device tier's blocks) layer by layer into the request's pages
   while the job waits for its batch. The prefix is the device tier's blocks, then this host's store's, then
   the other host's; the rest is computed.
2. The forward waits for layer i of the prefix before computing layer i (`kv.wait_layer_loaded`), and after
   it `plan.store_layer` queues layer i of the blocks this host lacks (computed ones, and fetched ones: that
   is hot-block replication) for this host's store and, for prefill, the decode host's reserved destinations.
3. `close_store(commit)` commits the new blocks (or aborts them) and ends every read lease; `kv.release()`
   (the plan's owner calls it) frees pages and staging; `close(commit=True)` first marks the prompt's full blocks
   complete, so they stay in the device prefix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncaked.engine.batch import PrefillSeq
from mooncaked.kv.keys import KEY_BYTES, block_keys, isolated_namespace
from mooncaked.kv.tenant_quota import TenantShare
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.roles.worker.messages import Destination, StoreTenant
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import InvalidArgument, ResourceExhausted
from mooncaked.store.client import incarnation_of
from mooncaked.store.messages import WriteHandle

logger = logging.getLogger(__name__)


@dataclass
class KvPlan:
    """Owns one prompt's store handles and leases on a worker (and, through `kv`, its pages and staging)."""

    kv: RequestKv
    token_ids: list[int]
    num_prefix_blocks: int = 0
    num_fetched_blocks: int = 0
    local_handles: list[tuple[int, WriteHandle]] = field(default_factory=list)  # (block index, handle)
    local_lease_ids: list[int] = field(default_factory=list)
    remote_leases: list[tuple[str, int]] = field(default_factory=list)  # (store name, lease id)
    destinations: dict[str, list[Destination]] = field(default_factory=dict)  # store name -> blocks it wants
    is_closed: bool = False
    is_cancelled: bool = False  # set by the event loop; the compute thread then posts no more writes
    owner: dict[str, Any] = field(default_factory=dict)  # allocate()'s tenant and share (store_owner)
    sources: list[StoreBlocks] = field(default_factory=list)  # where the reused prefix's blocks are read from

    def prefill_seq(self) -> PrefillSeq:
        num_cached = self.num_prefix_blocks * self.kv.worker.block_size
        return PrefillSeq(token_ids=self.token_ids[num_cached:], num_cached_tokens=num_cached,
                          page_ids=self.kv.page_ids)

    def layer_writes(self) -> list[StoreBlocks]:
        """Where each layer goes: this host's new blocks, then every destination's."""
        local = StoreBlocks(self.kv.worker.stores.local_name, [i for i, _ in self.local_handles],
                            [h.offset for _, h in self.local_handles], incarnation_of(h for _, h in self.local_handles))
        return [local, *(StoreBlocks(store_name, [d.block_index for d in wanted], [d.handle.offset for d in wanted],
                                     incarnation_of(d.handle for d in wanted))
                         for store_name, wanted in self.destinations.items())]

    def store_layer(self, layer: int) -> None:
        """Compute thread, after layer `layer`: queue its new KV for every destination (copy, then writes)."""
        writes = [write for write in self.layer_writes() if write.block_indices]
        if writes and not self.is_cancelled:
            self.kv.store_layer(layer, writes)

    async def close_store(self, commit: bool) -> None:
        """Commit (or abort) the new blocks and end the read leases; idempotent, never raises."""
        if self.is_closed:
            return
        self.is_closed = True
        local = self.kv.worker.stores.local
        handle_ids = [h.handle_id for _, h in self.local_handles]
        try:
            if handle_ids:
                await (local.commit(handle_ids) if commit else local.abort(handle_ids))
            if self.local_lease_ids:
                await local.release(self.local_lease_ids)
            for store_name, lease_id in self.remote_leases:
                await (await self.kv.worker.stores.client(store_name)).release([lease_id])
        except Exception as exc:  # the store reclaims them when their leases expire
            logger.warning("ending store handles of %s failed: %s", self.kv.request_id, exc)

    @property
    def num_device_blocks(self) -> int:
        """Prefix blocks read in place from the device prefix cache (the first of the prefix)."""
        return min(self.kv.num_device_blocks, self.num_prefix_blocks)

    async def close(self, commit: bool) -> None:
        if commit:
            self.kv.mark_complete()
        await self.kv.settle_writes(self.kv.worker.config.transfer.timeout_s)
        await self.kv.release()  # stops the loader first: no read may use a lease ended below
        if not self.kv.is_settled:  # a copy may still touch pool regions: leave them to their leases' expiry
            logger.error("%s: store handles and leases are left to expire", self.kv.request_id)
            return
        await self.close_store(commit)


def check_block_keys(worker: Worker, token_ids: Sequence[int], keys: Sequence[bytes],
                     isolation: bytes = b"") -> list[bytes]:
    if isolation and len(isolation) != KEY_BYTES:
        raise InvalidArgument(f"key_isolation must be {KEY_BYTES} bytes or empty, got {len(isolation)}")
    expected = block_keys(token_ids, worker.block_size, isolated_namespace(worker.namespace, isolation))
    if list(keys) != expected:
        raise InvalidArgument("block_keys do not match the token ids under this instance's model namespace "
                              "(model id, dtype and block size must agree across the cluster)")
    return expected


async def plan_prompt_kv(worker: Worker, request_id: str, token_ids: list[int], keys: Sequence[bytes], *,
                         timeout_s: float, num_extra_tokens: int = 0, fetch_store: str = "",
                         num_fetch_blocks: int = 0, decode_store: str = "",
                         destinations: Sequence[Destination] = (), key_isolation: bytes = b"",
                         tenant: StoreTenant | None = None, reuses_prefix: bool = True,
                         reserved_by: str = "") -> KvPlan:
    """Steps 1 of the module docstring; on failure everything taken so far is given back. Without
    `reuses_prefix` every token is computed (prompt logprobs need every row), cached blocks or not."""
    _check_prompt(worker, token_ids)
    keys = check_block_keys(worker, token_ids, keys, key_isolation)
    owner = store_owner(tenant)
    for store_name in (fetch_store, decode_store if destinations else ""):
        if store_name:
            worker.stores.instance_of(store_name)
    num_shareable = (len(token_ids) - 1) // worker.block_size if reuses_prefix else 0  # >= 1 token to compute
    try:
        kv = RequestKv(worker, request_id, len(token_ids), num_extra_tokens, reserved_by, block_keys=keys,
                       num_shareable_blocks=num_shareable)
    except RuntimeError as exc:
        raise ResourceExhausted(f"not enough KV pages for {len(token_ids)} tokens: {exc}") from None
    plan = KvPlan(kv, list(token_ids), owner=owner)
    if destinations:
        plan.destinations[decode_store] = list(destinations)
    try:
        fetched = StoreBlocks(fetch_store, [], [])
        if fetch_store and fetch_store != worker.stores.local_name and num_fetch_blocks > 0:
            fetched = await _lookup_remote(plan, fetch_store, keys[:num_fetch_blocks], timeout_s)
        sources = await _reserve_local(plan, keys, fetched, timeout_s, reuses_prefix)
    except BaseException:
        await plan.close(commit=False)
        raise
    plan.sources = [source for source in sources if source.block_indices]
    plan.kv.start_loading(plan.sources, plan.num_prefix_blocks if plan.sources else 0)
    return plan


def store_owner(tenant: StoreTenant | None) -> dict[str, Any]:
    """StoreClient.allocate's `tenant` and `share` for a request's new blocks ({} without a tenant)."""
    if tenant is None:
        return {}
    try:
        return {"tenant": tenant.id, "share": TenantShare(tenant.pool_share, tenant.min_pool_share)}
    except ValueError as exc:
        raise InvalidArgument(f"tenant: {exc}") from None


def _check_prompt(worker: Worker, token_ids: Sequence[int]) -> None:
    assert worker.loaded is not None
    if not token_ids:
        raise InvalidArgument("the prompt has no tokens")
    vocab_size = worker.loaded.args.vocab_size
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise InvalidArgument(f"token ids must be in [0, {vocab_size})")
    if len(token_ids) > worker.config.model.max_model_len:
        raise InvalidArgument(f"prompt of {len(token_ids)} tokens exceeds model.max_model_len "
                              f"{worker.config.model.max_model_len}")


def _lease_ms(worker: Worker, timeout_s: float) -> int:
    """Outlive the request's deadline (store.default_lease_ms at least), within store.max_lease_ms."""
    store = worker.config.store
    return min(max(int(timeout_s * 1000) + 5_000, store.default_lease_ms), store.max_lease_ms)


async def _lookup_remote(plan: KvPlan, fetch_store: str, keys: list[bytes], timeout_s: float) -> StoreBlocks:
    """Lease the longest prefix of `keys` held by `fetch_store` (its block indices and pool offsets there)."""
    worker = plan.kv.worker
    remote = await worker.stores.client(fetch_store)
    found = await remote.lookup(keys, lease_ms=_lease_ms(worker, timeout_s))
    if found.read_lease_id:
        plan.remote_leases.append((fetch_store, found.read_lease_id))
    index_of = {key: i for i, key in enumerate(keys)}
    return StoreBlocks(fetch_store, [index_of[loc.key] for loc in found.locations],
                       [loc.offset for loc in found.locations], incarnation_of(found.locations))


async def _reserve_local(plan: KvPlan, keys: list[bytes], fetched: StoreBlocks, timeout_s: float,
                         reuses_prefix: bool) -> list[StoreBlocks]:
    """Allocate this host's store space for the blocks it lacks; the prefix and where each block of it is."""
    worker = plan.kv.worker
    local = worker.stores.local
    try:
        reply = await local.allocate(keys, worker.block_nbytes, _lease_ms(worker, timeout_s), **plan.owner)
        present, handles, lease_id = reply.present, reply.handles, reply.read_lease_id
    except ResourceExhausted:  # the store is full of pinned or leased blocks: reuse, but do not cache
        found = await local.lookup(keys, lease_ms=_lease_ms(worker, timeout_s))
        present, handles, lease_id = found.locations, [], found.read_lease_id
    if lease_id:
        plan.local_lease_ids.append(lease_id)
    index_of = {key: i for i, key in enumerate(keys)}
    plan.local_handles = [(index_of[h.key], h) for h in handles]
    local_offsets = {index_of[loc.key]: loc.offset for loc in present}
    remote = dict(zip(fetched.block_indices, fetched.offsets))
    num_device = plan.kv.num_device_blocks  # already in the pages
    num_prefix = num_device
    while num_prefix < len(keys) and (num_prefix in local_offsets or num_prefix in remote):
        num_prefix += 1
    num_prefix = min(num_prefix, (len(plan.token_ids) - 1) // worker.block_size)  # >= 1 token to compute
    if not reuses_prefix:
        num_prefix = 0
    plan.num_prefix_blocks = num_prefix
    from_local = [i for i in range(num_device, num_prefix) if i in local_offsets]
    from_remote = [i for i in range(num_device, num_prefix) if i not in local_offsets]
    plan.num_fetched_blocks = len(from_remote)
    return [StoreBlocks(worker.stores.local_name, from_local, [local_offsets[i] for i in from_local],
                        incarnation_of([*present, *handles])),
            StoreBlocks(fetched.store_name, from_remote, [remote[i] for i in from_remote], fetched.incarnation)]
