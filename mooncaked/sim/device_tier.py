"""One instance's device prefix cache in the simulator (a single prefill instance's, or a decode instance's):
the engine's own policy (kv/device_cache.py) over page ids, as engine/page_allocator.py's PageAllocator drives it.

1. `start(job, keys, num_pages)` when a prefill starts (on a decode instance: an inline prefill, or a prefilled
   request's KV arriving): the longest cached prefix of `keys` (the blocks it may reuse) is read in place (one
   reader each), and the job takes `num_pages` less those for the rest of its prompt, evicting the least recently
   used unreferenced cached pages when no page is free. Returns how many blocks it read from the device tier.
   `start_prompt` derives keys and pages from a prompt as the engine does (at least one token computed).
2. `finish(job, keys)` when it ends: its pages holding full prompt blocks stay cached under their keys (deepest
   first, so they are evicted first), the rest are freed, its reads end.
3. Every change is published to the simulator's device index (a sequenced change per call), which Algorithm 1
   reads for the instance's local prefix, as the conductor's device index is fed by LOAD replies.
Owner: its PrefillInstance or DecodeInstance (the simulator's engine and prefill side are the only callers).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from mooncaked.kv.device_cache import DevicePrefixCache
from mooncaked.sched.shadow_index import ShadowIndex


class DeviceTier:
    """Owns the instance's device prefix cache, its free page ids and what each running job holds and reads."""

    def __init__(self, instance_id: str, num_pages: int, index: ShadowIndex) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.instance_id = instance_id
        self.num_pages = num_pages
        self.cache = DevicePrefixCache()
        self._free = list(range(num_pages))
        self._own: dict[int, list[int]] = {}  # job -> pages it writes
        self._shared: dict[int, list[int]] = {}  # job -> cached pages it reads
        self._index = index
        self._seq = 0
        index.apply_dump(instance_id, 0, [])

    @property
    def num_free(self) -> int:
        return len(self._free) + self.cache.num_reclaimable

    def start(self, job: int, keys: Sequence[Hashable], num_pages: int) -> int:
        shared = self.cache.match(keys)
        self.cache.acquire(shared)
        num_own = max(num_pages - len(shared), 0)
        if num_own > len(self._free):
            self._free.extend(self.cache.evict(num_own - len(self._free)))
        # a prompt longer than the pages left (the daemon would refuse it) caches only the blocks it got pages for
        own = [self._free.pop() for _ in range(min(num_own, len(self._free)))]
        self._own[job], self._shared[job] = own, shared
        self._publish()
        return len(shared)

    def start_prompt(self, job: int, keys: Sequence[Hashable], num_prompt_tokens: int, block_size: int) -> int:
        """`start` for a prompt of `num_prompt_tokens` over its block `keys`: reusable are the full blocks before
        its last token (which is always computed); it takes a page per block, the last one partial."""
        num_usable = max(num_prompt_tokens - 1, 0) // block_size
        return self.start(job, keys[:num_usable], -(-num_prompt_tokens // block_size))

    def is_running(self, job: int) -> bool:
        return job in self._own

    def finish(self, job: int, keys: Sequence[Hashable]) -> None:
        own, shared = self._own.pop(job), self._shared.pop(job)
        kept: set[int] = set()
        for i in reversed(range(len(shared), min(len(keys), len(shared) + len(own)))):
            page = own[i - len(shared)]
            if self.cache.insert(keys[i], page):
                kept.add(page)
        self._free.extend(page for page in own if page not in kept)
        self.cache.release(reversed(shared))
        self._publish()

    def _publish(self) -> None:
        gained, lost = self.cache.drain_changes()
        if gained or lost:
            self._index.apply_changes(self.instance_id, self._seq, self._seq + 1, gained, lost)
            self._seq += 1
