"""The device prefix cache's policy: which device pages hold which block key, who reads them, what to evict.

1. A finished request's full blocks stay in its instance's device pages: `insert(key, page)` hands the page to the
   cache, unreferenced (a key already cached keeps its first page; the caller frees the second).
2. A new request reads the longest cached prefix of its block keys in place: `match(keys)` names the pages,
   `acquire(pages)` counts one more reader of each (read-only: a sequence writes only pages after its prefix),
   `release(pages)` one fewer when the sequence ends. A page with readers is never evicted.
3. `evict(num_pages)`: the least recently used unreferenced pages, for a request that needs pages when no page is
   free; they leave the index (the caller owns them again). Released and inserted together, a prefix's pages
   are given in reverse block order, so its deepest blocks are evicted first: a chain's first block, which every
   later block's match needs, goes last.
4. `drain_changes()` returns the keys gained and lost since the last call (the instance reports them to the
   conductor, whose placement counts this tier in a request's local prefix).

Keys are block keys (kv/keys.py): they fold in the model, dtype, block size, KV geometry, and the tenant or
cache_salt isolation tag, so a page is only ever matched by requests allowed to share it. Pure: no I/O, no torch,
no clock (recency is the order of calls). The engine's page allocator (engine/page_allocator.py) and the simulator
(sim/device_tier.py) are its owners.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class DevicePrefixCache:
    """Owns the key <-> page index of cached pages, their reader counts and the LRU order of unreferenced ones.
    Owner: one instance's page allocator (or the simulator's model of one instance)."""

    def __init__(self) -> None:
        self._page_of: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}
        self._readers: dict[int, int] = {}  # cached page -> running sequences reading it (absent: none)
        self._idle: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, least recently used first
        self._gained: dict[Hashable, None] = {}
        self._lost: dict[Hashable, None] = {}

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def num_reclaimable(self) -> int:
        """Cached pages no sequence reads: free for a new request (evicted when it needs them)."""
        return len(self._idle)

    @property
    def num_referenced(self) -> int:
        return len(self._readers)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._page_of

    def keys(self) -> list[Hashable]:
        return list(self._page_of)

    def is_cached_page(self, page: int) -> bool:
        return page in self._key_of

    def readers_of(self, page: int) -> int:
        return self._readers.get(page, 0)

    def match(self, keys: Sequence[Hashable]) -> list[int]:
        """The pages of the longest prefix of `keys` held here (no reader counted yet: see acquire)."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Iterable[int]) -> None:
        """One more reader of each page (a page may repeat: one reader per mention)."""
        for page in pages:
            if page not in self._key_of:
                raise ValueError(f"page {page} is not in the device prefix cache")
            self._readers[page] = self._readers.get(page, 0) + 1
            self._idle.pop(page, None)

    def release(self, pages: Iterable[int]) -> None:
        """One fewer reader of each; a page nobody reads becomes the most recently used unreferenced one."""
        for page in pages:
            count = self._readers.get(page, 0)
            if count <= 0:
                raise ValueError(f"page {page} has no reader to release")
            if count == 1:
                del self._readers[page]
                self._idle[page] = None
            else:
                self._readers[page] = count - 1

    def insert(self, key: Hashable, page: int) -> bool:
        """Cache `page` as `key`'s block, unreferenced and most recently used; False (nothing changes) when `key`
        is already cached or the page already holds a key: the caller keeps the page."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        self._idle[page] = None
        self._note(key, is_stored=True)
        return True

    def evict(self, num_pages: int) -> list[int]:
        """Up to `num_pages` unreferenced pages, least recently used first, out of the cache (now the caller's)."""
        evicted: list[int] = []
        while len(evicted) < num_pages and self._idle:
            page, _ = self._idle.popitem(last=False)
            key = self._key_of.pop(page)
            del self._page_of[key]
            self._note(key, is_stored=False)
            evicted.append(page)
        return evicted

    def drain_changes(self) -> tuple[list[Hashable], list[Hashable]]:
        """(keys gained, keys lost) since the last call; a key gained then lost in between appears in neither."""
        gained, lost = list(self._gained), list(self._lost)
        self._gained.clear()
        self._lost.clear()
        return gained, lost

    def _note(self, key: Hashable, is_stored: bool) -> None:
        into, other = (self._gained, self._lost) if is_stored else (self._lost, self._gained)
        if key in other:  # lost then gained (or gained then lost) between two reports: the conductor's view holds
            del other[key]
        else:
            into[key] = None

    def check(self) -> None:
        """Internal invariants (tests): the index is a bijection; every cached page is read or idle, not both."""
        assert len(self._page_of) == len(self._key_of)
        assert all(self._key_of[page] == key for key, page in self._page_of.items())
        assert all(count > 0 and page in self._key_of for page, count in self._readers.items())
        assert all(page in self._key_of and page not in self._readers for page in self._idle)
        assert len(self._readers) + len(self._idle) == len(self._key_of)
