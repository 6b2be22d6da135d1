"""A role that registers itself in the cluster's membership (`cluster.membership: etcd`).

1. `start()`: start the membership (lease, registration as `starting`, first listing), start the role, which
   reads and follows the membership, then publish `ready`: from here conductors place work on it.
2. `stop()`: publish `draining` and wait `cluster.etcd.drain_notice_s` so every conductor has stopped placing
   work here, then stop the role (it drains what it holds), then stop the membership, which revokes the lease:
   the record disappears at once. A killed process leaves its record until the lease expires.

Owns the membership and the wrapped role.
"""

from __future__ import annotations

import asyncio
import logging

from mooncaked.cluster.etcd_membership import EtcdMembership
from mooncaked.cluster.membership import Membership, StaticMembership
from mooncaked.config import Config, InstanceConfig
from mooncaked.runtime.lifecycle import Role

logger = logging.getLogger(__name__)


def make_membership(config: Config, me: InstanceConfig | None) -> Membership:
    """The membership `cluster.membership` names, for instance `me` (None: a reader that is no instance)."""
    if config.cluster.membership == "etcd":
        return EtcdMembership(config, me)
    return StaticMembership(config, me)


class MemberRole:
    """See the module docstring."""

    def __init__(self, inner: Role, membership: Membership, drain_notice_s: float) -> None:
        self.inner = inner
        self.membership = membership
        self.drain_notice_s = drain_notice_s
        self.name = inner.name
        self._is_serving = False

    async def start(self) -> None:
        await self.membership.start()
        await self.inner.start()
        await self.membership.set_state("ready")
        self._is_serving = True

    async def stop(self) -> None:
        try:
            if self._is_serving:
                self._is_serving = False
                await self.membership.set_state("draining")
                await asyncio.sleep(self.drain_notice_s)  # conductors see `draining` before we refuse work
            await self.inner.stop()
        finally:
            await self.membership.stop()
