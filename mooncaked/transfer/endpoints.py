"""RDMA endpoint pool: one RC queue pair per (peer, local NIC, remote NIC), built on demand, capped by SIEVE.

1. `acquire` returns the endpoint for a key, connecting a new queue pair (outside the lock) when there is none.
2. Inserting beyond `capacity` evicts by SIEVE among endpoints nobody is using; evicted endpoints are handed to
   `on_evict` (which closes the queue pair and tells the peer).
3. `discard` removes a broken endpoint (a failed completion): the next `acquire` for its key builds a new one.
4. Passive endpoints (the target side of a peer's `connect`) live in the same pool under their own keys.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from mooncaked.transfer.sieve import SieveCache
from mooncaked.transfer.verbs import VerbsQueuePair

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointKey:
    is_active: bool  # True: we initiate on it; False: a peer initiates on it
    peer: str
    local_nic: str
    remote_nic: str


@dataclass(eq=False)
class Endpoint:
    key: EndpointKey
    qp: VerbsQueuePair
    num_users: int = 0


EvictHandler = Callable[[Endpoint], None]


class EndpointPool:
    """Owns every endpoint of one engine (active and passive) and their queue pairs; thread-safe."""

    def __init__(self, capacity: int, on_evict: EvictHandler) -> None:
        self._cache: SieveCache[EndpointKey, Endpoint] = SieveCache(capacity)
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self.num_connects = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def keys(self) -> list[EndpointKey]:
        with self._lock:
            return [key for key, _ in self._cache.items()]

    def acquire(self, key: EndpointKey, connect: Callable[[], VerbsQueuePair]) -> Endpoint:
        with self._lock:
            endpoint = self._cache.get(key)
            if endpoint is not None:
                endpoint.num_users += 1
                return endpoint
        endpoint = Endpoint(key, connect(), num_users=1)
        self._insert(endpoint)
        return endpoint

    def release(self, endpoint: Endpoint) -> None:
        with self._lock:
            endpoint.num_users -= 1

    def discard(self, endpoint: Endpoint) -> None:
        with self._lock:
            endpoint.num_users -= 1
            if self._cache.get(endpoint.key) is endpoint:
                self._cache.pop(endpoint.key)
        endpoint.qp.close()

    def put_passive(self, key: EndpointKey, qp: VerbsQueuePair) -> None:
        with self._lock:
            old = self._cache.pop(key)
        if old is not None:
            old.qp.close()
        self._insert(Endpoint(key, qp))

    def close_passive(self, key: EndpointKey) -> bool:
        """Close the passive endpoint for `key`; False when there was none."""
        with self._lock:
            old = self._cache.pop(key)
        if old is None:
            return False
        old.qp.close()
        return True

    def close_all(self) -> None:
        with self._lock:
            endpoints = [endpoint for _, endpoint in self._cache.items()]
            for endpoint in endpoints:
                self._cache.pop(endpoint.key)
        for endpoint in endpoints:
            endpoint.qp.close()

    def _insert(self, endpoint: Endpoint) -> None:
        with self._lock:
            self.num_connects += endpoint.key.is_active
            evicted = self._cache.put(endpoint.key, endpoint, can_evict=lambda e: e.num_users == 0)
            if len(self._cache) > self._cache.capacity:
                logger.warning("endpoint pool over its cap of %d: every endpoint is in use", self._cache.capacity)
        for _, victim in evicted:
            self._on_evict(victim)
