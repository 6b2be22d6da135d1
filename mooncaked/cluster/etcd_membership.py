"""Membership in etcd (`cluster.membership: etcd`): leases for liveness, one watch for joins, leaves and elections.

Keys, under `<cluster.etcd.prefix>/<cluster.id>/`:
  `instances/<name>`  a MemberRecord (JSON), attached to the instance's lease: a killed instance's record goes
                      when its lease expires, `lease_ttl_s` after its last keep-alive.
  `election/<name>`   a conductor's candidacy, on its lease; the oldest key (lowest create revision) leads.

1. `start()` starts the session task and waits (up to `startup_timeout_s`) for the first listing.
2. A session: grant a lease (or keep the one still alive), put this instance's record and candidacy, list the
   prefix (the table becomes exactly that), then keep the lease alive every TTL/3 while one watch stream,
   reopened from the last revision it saw, applies each change to the table. Each answered grant or keep-alive
   says how long the lease surely lives (from when it was sent); past that this instance leads nothing even
   before a call fails (a cut link: etcd may have expired the lease and another conductor lead).
3. Any failure ends the session, and this instance steps down at once: it is no longer connected, so it leads
   nothing (`leader()` is None) until a new session has registered again. The table keeps the membership last
   seen (nothing is removed while etcd cannot say), `status()` and the log say etcd is unreachable, and a new
   session starts after a backoff that doubles from `min_backoff_s` to `max_backoff_s`. After an etcd error the
   new session keeps the lease if etcd still holds it (its keys and candidacy are then still in place); a lease
   found expired is granted anew and everything put again. After any other exception (a reply we misread, a
   listener's bug) nothing about the lease can be trusted: it is revoked and a fresh one granted, so the
   candidacy goes to the back of the election. The next listing removes whoever left meanwhile. The session
   task itself is supervised (runtime/supervised.py).
4. `stop()` cancels the session and revokes the lease, so this instance's keys disappear at once.

Owner of the etcd client, the lease, this instance's record, the member table and the candidate table.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time

from mooncaked.cluster.etcd_access import etcd_auth, etcd_ssl_context
from mooncaked.cluster.etcd_client import EtcdClient, EtcdError, KeyValue, WatchEvent
from mooncaked.cluster.membership import Listener, MemberRecord, MemberState, MembershipStatus, MemberTable
from mooncaked.config import Config, InstanceConfig
from mooncaked.runtime.supervised import start_supervised, stop_task

logger = logging.getLogger(__name__)


class EtcdMembership:
    """See the module docstring."""

    def __init__(self, config: Config, me: InstanceConfig | None) -> None:
        self.etcd_config = config.cluster.etcd
        self.me = me
        self.client = EtcdClient(self.etcd_config.endpoints, self.etcd_config.call_timeout_s,
                                 ssl_context=etcd_ssl_context(self.etcd_config), auth=etcd_auth(self.etcd_config))
        base = f"{self.etcd_config.prefix.rstrip('/')}/{config.cluster.id}/"
        self.instances_prefix = (base + "instances/").encode()
        self.election_prefix = (base + "election/").encode()
        self.base_prefix = base.encode()
        self.record = MemberRecord.for_instance(config, me, "starting") if me is not None else None
        self.table = MemberTable()
        self.candidates: dict[str, int] = {}  # conductor name -> create revision of its candidacy
        self.lease_id = 0
        # monotonic time by which etcd may have expired the lease: the last grant or keep-alive's send time plus
        # the TTL it returned. Past it this instance leads nothing, even if no call has failed yet (a cut link)
        self.lease_valid_until = 0.0
        self.is_campaigning = False
        self.is_connected = False
        self.last_error = ""
        self.num_sessions = 0
        self._disconnected_at: float | None = time.monotonic()
        self._leader_listeners: list[asyncio.Event] = []
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- the Membership interface ----------------------------------------------------------------------
    def members(self) -> dict[str, MemberRecord]:
        return dict(self.table.records)

    def add_listener(self, listener: Listener) -> None:
        self.table.add_listener(listener)

    async def start(self) -> None:
        self._task = start_supervised("etcd-membership", self._run)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), self.etcd_config.startup_timeout_s)
        if not self._synced.is_set():
            logger.warning("etcd: no listing within %.1f s (%s); serving without it and retrying",
                           self.etcd_config.startup_timeout_s, self.last_error or "no answer")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        if self.lease_id:
            try:
                await self.client.revoke(self.lease_id)
            except EtcdError as exc:
                logger.warning("etcd: could not revoke lease %x (its keys expire with it): %s", self.lease_id, exc)
            self.lease_id = 0
        await self.client.close()

    async def set_state(self, state: MemberState, role: str | None = None) -> None:
        """Publish this instance's new state (and role); if etcd is down it is published on reconnection."""
        assert self.record is not None, "only a registered instance has a state"
        self.record = dataclasses.replace(self.record, state=state, role=role or self.record.role)
        self.table.apply(self.record.name, self.record)
        if self.is_connected and self.lease_id:
            try:
                await self.client.put(self.instances_prefix + self.record.name.encode(), self.record.to_json(),
                                      self.lease_id)
            except EtcdError as exc:
                logger.warning("etcd: publishing state %s failed (retried on reconnection): %s", state, exc)
        logger.info("membership: %s is %s (%s)", self.record.name, state, self.record.role)

    def status(self) -> MembershipStatus:
        since = self._disconnected_at
        return MembershipStatus("etcd", self.is_connected, self.last_error,
                                0.0 if since is None else time.monotonic() - since, len(self.table.records))

    # ---- election ---------------------------------------------------------------------------------------
    async def campaign(self) -> None:
        """Stand for leader (conductors); the candidacy lives on this instance's lease."""
        self.is_campaigning = True
        if self.is_connected:
            with contextlib.suppress(EtcdError):  # else put at the next session
                await self._put_candidacy()

    def leader(self) -> str | None:
        """The current leader's name while etcd is reachable and this instance's lease surely lives; None
        otherwise (no one can be sure: another may lead once etcd expired this lease)."""
        if not self.is_connected or not self.candidates or time.monotonic() >= self.lease_valid_until:
            return None
        return min(self.candidates.items(), key=lambda item: item[1])[0]

    def is_leader(self) -> bool:
        return self.me is not None and self.leader() == self.me.name

    def leader_changed(self) -> asyncio.Event:
        """An event set at the next change of candidates or connection (a fresh one per caller)."""
        event = asyncio.Event()
        self._leader_listeners.append(event)
        return event

    def _notify_leader(self) -> None:
        events, self._leader_listeners = self._leader_listeners, []
        for event in events:
            event.set()

    # ---- sessions ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff_s = self.etcd_config.min_backoff_s
        while True:
            started = time.monotonic()
            try:
                await self._session()
            except EtcdError as exc:
                self._disconnected(str(exc))
            except Exception as exc:
                logger.exception("etcd session failed unexpectedly; stepping down and registering anew on a fresh "
                                 "lease")
                self._disconnected(f"{type(exc).__name__}: {exc}")
                await self._drop_lease()
            if time.monotonic() - started > self.etcd_config.max_backoff_s:
                backoff_s = self.etcd_config.min_backoff_s  # it had been working: start the backoff anew
            await asyncio.sleep(backoff_s * random.uniform(0.8, 1.2))
            backoff_s = min(backoff_s * 2, self.etcd_config.max_backoff_s)

    async def _drop_lease(self) -> None:
        """Forget the lease (the next session grants a fresh one); revoke it so that its keys go at once."""
        lease_id, self.lease_id = self.lease_id, 0
        if not lease_id:
            return
        try:
            await self.client.revoke(lease_id)
        except EtcdError as exc:
            logger.warning("etcd: could not revoke lease %x (its keys expire with it): %s", lease_id, exc)

    def _disconnected(self, reason: str) -> None:
        if self.is_connected or not self.last_error:
            logger.warning("etcd unreachable (%s); keeping the membership last seen (%d instances), retrying",
                           reason, len(self.table.records))
        else:
            logger.debug("etcd still unreachable: %s", reason)
        if self._disconnected_at is None:
            self._disconnected_at = time.monotonic()
        self.is_connected, self.last_error = False, reason
        self._notify_leader()

    async def _session(self) -> None:
        await self._register()
        kvs, revision = await self.client.get_prefix(self.base_prefix)
        self._replace(kvs)
        if self.last_error:
            logger.warning("etcd reachable again; %d instances", len(self.table.records))
        self.is_connected, self.last_error, self._disconnected_at = True, "", None
        self.num_sessions += 1
        self._synced.set()
        self._notify_leader()
        tasks = [asyncio.create_task(self._watch(revision + 1), name="etcd-watch")]
        if self.lease_id:
            tasks.append(asyncio.create_task(self._keepalive(), name="etcd-keepalive"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _register(self) -> None:
        if self.record is None:
            return
        sent_at = time.monotonic()
        ttl_s = await self.client.keepalive(self.lease_id) if self.lease_id else 0
        if ttl_s <= 0:
            if self.lease_id:
                logger.warning("etcd: lease %x expired while unreachable; registering again", self.lease_id)
            sent_at = time.monotonic()
            self.lease_id = await self.client.grant(self.etcd_config.lease_ttl_s)
            ttl_s = self.etcd_config.lease_ttl_s
        self.lease_valid_until = sent_at + ttl_s
        await self.client.put(self.instances_prefix + self.record.name.encode(), self.record.to_json(),
                              self.lease_id)
        if self.is_campaigning:
            await self._put_candidacy()

    async def _put_candidacy(self) -> None:
        assert self.me is not None and self.lease_id
        key = self.election_prefix + self.me.name.encode()
        if not await self.client.put_if_absent(key, self.me.name.encode(), self.lease_id):
            kvs, _ = await self.client.get_prefix(key)
            mine = [kv for kv in kvs if kv.key == key]
            if mine and mine[0].lease != self.lease_id:  # a former life's candidacy
                await self.client.delete(key)
                await self.client.put_if_absent(key, self.me.name.encode(), self.lease_id)

    async def _keepalive(self) -> None:
        interval_s = self.etcd_config.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval_s)
            sent_at = time.monotonic()
            ttl_s = await self.client.keepalive(self.lease_id)
            if ttl_s <= 0:
                raise EtcdError(f"lease {self.lease_id:x} expired")
            self.lease_valid_until = sent_at + ttl_s

    async def _watch(self, revision: int) -> None:
        while True:
            async for events in self.client.watch_prefix(self.base_prefix, revision, self.etcd_config.watch_renew_s):
                for event in events:
                    self._apply(event)
                    revision = max(revision, event.kv.mod_revision + 1)

    # ---- applying keys ----------------------------------------------------------------------------------
    def _replace(self, kvs: list[KeyValue]) -> None:
        records: dict[str, MemberRecord] = {}
        self.candidates = {}
        for kv in kvs:
            if kv.key.startswith(self.instances_prefix):
                record = self._record(kv)
                if record is not None:
                    records[record.name] = record
            elif kv.key.startswith(self.election_prefix):
                self.candidates[kv.key[len(self.election_prefix):].decode(errors="replace")] = kv.create_revision
        self.table.replace_all(records)

    def _apply(self, event: WatchEvent) -> None:
        key = event.kv.key
        if key.startswith(self.election_prefix):
            name = key[len(self.election_prefix):].decode(errors="replace")
            if event.kind == "delete":
                self.candidates.pop(name, None)
            else:
                self.candidates.setdefault(name, event.kv.create_revision)
            self._notify_leader()
        elif key.startswith(self.instances_prefix):
            name = key[len(self.instances_prefix):].decode(errors="replace")
            self.table.apply(name, None if event.kind == "delete" else self._record(event.kv))

    def _record(self, kv: KeyValue) -> MemberRecord | None:
        try:
            record = MemberRecord.from_json(kv.value)
        except (ValueError, TypeError) as exc:
            logger.warning("etcd: ignoring %s: %s", kv.key.decode(errors="replace"), exc)
            return None
        if kv.key != self.instances_prefix + record.name.encode():
            logger.warning("etcd: ignoring %s: it describes %r", kv.key.decode(errors="replace"), record.name)
            return None
        return record
