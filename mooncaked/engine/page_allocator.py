"""The allocator of a worker's KV page ids (the pages themselves: engine/kv_pages.py).

1. Requests take whole pages from one `PageAllocator(num_pages)` (`allocate(n, owner)`; a worker's is
   `Worker.pages`).
2. When a request ends (or fails) its owner frees its pages (`free` / `free_owner`).
3. With a device prefix cache (kv/device_cache.py; `kv.device_prefix_cache`), a finished request first hands its
   full blocks' pages to the cache (`keep(owner, keyed_pages)`) and a new one reads the longest cached prefix of
   its block keys in place (`share_prefix(keys, owner)`: one reader each, released with the owner's pages).
   Cached pages nobody reads count as free (`num_free`): `allocate` evicts the least recently used of them when
   the free list runs short, so the cache never refuses a request pages an empty cache would have given it.
4. A parallel sampling's sequences hold their prompt's full-block pages together (`share(pages, from_owner,
   to_owner)`: read-only, one holder per sequence; cached ones gain a reader): a page is freed once its last
   holder frees it, and goes to the cache (`keep`) only from its last holder.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from mooncaked.kv.device_cache import DevicePrefixCache


class PagesExhausted(RuntimeError):
    """Not enough free pages; nothing was allocated."""


class PageAllocator:
    """Owns the free list, which owners (request ids) hold each used page (one, or a parallel sampling's sequences
    sharing their prompt's pages), and the device prefix cache (the pages it holds, and which owners read which of
    them)."""

    def __init__(self, num_pages: int, cache: DevicePrefixCache | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.cache = cache
        self._free: deque[int] = deque(range(num_pages))
        self._holders_of: dict[int, list[str]] = {}  # used page -> its holders, the first one first (never empty)
        self._pages_of: dict[str, dict[int, None]] = {}  # insertion-ordered sets
        self._shared_of: dict[str, list[int]] = {}  # owner -> cached pages it reads, in block order

    @property
    def num_free(self) -> int:
        """Pages a request may take now: the free list and the cached pages nobody reads."""
        return len(self._free) + (self.cache.num_reclaimable if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        """Pages requests hold or read (cached pages no one reads are free)."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached if self.cache is not None else 0

    def allocate(self, num_pages: int, owner: str) -> list[int]:
        """All or nothing: `num_pages` page ids for `owner`, or PagesExhausted; evicts unreferenced cached pages
        (least recently used first) when the free list is short."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages > self.num_free:
            raise PagesExhausted(f"{owner}: needs {num_pages} KV pages, {self.num_free} free of {self.num_pages}")
        if num_pages > len(self._free):
            assert self.cache is not None
            self._free.extend(self.cache.evict(num_pages - len(self._free)))
        pages = [self._free.popleft() for _ in range(num_pages)]
        for page in pages:
            self._holders_of[page] = [owner]
        self._pages_of.setdefault(owner, {}).update(dict.fromkeys(pages))
        return pages

    def free(self, page_ids: Iterable[int], owner: str) -> None:
        """`owner` lets go of its pages, each freed once no other owner holds it; a page not held by `owner` raises
        ValueError and nothing is freed."""
        pages = list(page_ids)
        for page in pages:
            if owner not in self._holders_of.get(page, ()):
                raise ValueError(f"page {page} is not held by {owner!r} (holders: {self._holders_of.get(page)!r})")
        if len(set(pages)) != len(pages):
            raise ValueError(f"{owner}: page ids to free repeat: {pages}")
        held = self._pages_of[owner] if pages else {}
        for page in pages:
            holders = self._holders_of[page]
            holders.remove(owner)
            del held[page]
            if not holders:
                del self._holders_of[page]
                self._free.append(page)
        if pages and not held:
            del self._pages_of[owner]

    def transfer(self, from_owner: str, to_owner: str, num_pages: int | None = None) -> list[int]:
        """Up to `num_pages` (None: all) of the pages `from_owner` holds now belong to `to_owner` (a reservation's
        pages to its request's sequences)."""
        held = self._pages_of.get(from_owner, {})
        pages = [page for page in held if len(self._holders_of[page]) == 1][:num_pages]  # never a shared one
        for page in pages:
            del held[page]
            self._holders_of[page] = [to_owner]
        if not held:
            self._pages_of.pop(from_owner, None)
        if pages:
            self._pages_of.setdefault(to_owner, {}).update(dict.fromkeys(pages))
        return pages

    def free_owner(self, owner: str) -> int:
        """Free every page `owner` holds (cleanup after an abort) and end its reads of cached pages; returns how
        many pages it held."""
        pages = list(self._pages_of.get(owner, ()))
        self.free(pages, owner)
        shared = self._shared_of.pop(owner, [])
        if shared:
            assert self.cache is not None
            self.cache.release(reversed(shared))  # deepest block first: it is evicted first
        return len(pages)

    def share_prefix(self, keys: Sequence[bytes], owner: str) -> list[int]:
        """The cached pages of the longest prefix of `keys` (block keys, in order), read by `owner` until
        free_owner; [] without a cache. The owner must not write them."""
        if self.cache is None or not keys:
            return []
        pages = self.cache.match(keys)
        self.cache.acquire(pages)
        if pages:
            self._shared_of.setdefault(owner, []).extend(pages)
        return pages

    def share(self, page_ids: Sequence[int], from_owner: str, to_owner: str) -> None:
        """`to_owner` holds `from_owner`'s pages too, read-only (a parallel sampling's sequence, its prompt's full
        blocks): a held page gains a holder, a cached page `from_owner` reads gains a reader. A page `from_owner`
        neither holds nor reads raises ValueError and nothing is shared."""
        reads = set(self._shared_of.get(from_owner, ()))
        for page in page_ids:
            if page not in reads and from_owner not in self._holders_of.get(page, ()):
                raise ValueError(f"page {page} is neither held nor read by {from_owner!r}")
            if to_owner in self._holders_of.get(page, ()):
                raise ValueError(f"page {page} is held by {to_owner!r} already")
        for page in page_ids:
            if page in reads:
                assert self.cache is not None
                self.cache.acquire([page])
                self._shared_of.setdefault(to_owner, []).append(page)
            else:
                self._holders_of[page].append(to_owner)
                self._pages_of.setdefault(to_owner, {})[page] = None

    def shared_of(self, owner: str) -> list[int]:
        return list(self._shared_of.get(owner, ()))

    def keep(self, owner: str, keyed_pages: Sequence[tuple[bytes, int]]) -> int:
        """Hand `owner`'s pages holding full blocks, (block key, page) in block order, to the cache (pages of keys
        it holds already, and pages other owners still hold, stay the owner's, freed with the rest); returns how
        many it took. Call only once their KV is complete and nothing writes them any more."""
        if self.cache is None:
            return 0
        held = self._pages_of.get(owner, {})
        num_kept = 0
        for key, page in reversed(keyed_pages):  # deepest block first: the least recently used of the prefix
            if page in held and self._holders_of[page] == [owner] and self.cache.insert(key, page):
                del self._holders_of[page]
                del held[page]
                num_kept += 1
        if not held:
            self._pages_of.pop(owner, None)
        return num_kept

    def owner_of(self, page_id: int) -> str | None:
        """The page's first holder (None: free or cached)."""
        holders = self._holders_of.get(page_id)
        return holders[0] if holders else None

    def holders_of(self, page_id: int) -> list[str]:
        return list(self._holders_of.get(page_id, ()))

    def pages_of(self, owner: str) -> list[int]:
        return list(self._pages_of.get(owner, ()))
