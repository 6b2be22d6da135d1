"""The page allocator with a device prefix cache under random request interleavings (hypothesis state machine):
pages a running sequence reads or writes are never evicted nor handed to another request, reader counts match the
running sequences, a request only ever matches blocks of its own namespace (tenant / cache_salt), and cached pages
nobody reads count as free."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncaked.engine.page_allocator import PageAllocator, PagesExhausted
from mooncaked.kv.device_cache import DevicePrefixCache
from mooncaked.kv.keys import block_keys, isolated_namespace, isolation_tag, model_namespace

BLOCK = 4
NUM_PAGES = 24
NAMESPACE = model_namespace("m", "float32", BLOCK, "gqa")
NAMESPACES = [NAMESPACE, isolated_namespace(NAMESPACE, isolation_tag(cache_salt="s")),
              isolated_namespace(NAMESPACE, isolation_tag(tenant="t"))]
CONVERSATIONS = [[(c * 97 + i * 13) % 50 for i in range(8 * BLOCK)] for c in range(3)]


@dataclass
class Running:
    keys: list[bytes]
    shared: list[int]
    own: list[int]
    page_ids: list[int] = field(default_factory=list)


class PrefixPages(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pages = PageAllocator(NUM_PAGES, DevicePrefixCache())
        self.content: dict[int, bytes] = {}  # page -> the block key whose KV it holds (written by its owner)
        self.running: dict[str, Running] = {}
        self.num_started = 0

    @rule(conversation=st.integers(0, 2), namespace=st.integers(0, 2), num_blocks=st.integers(1, 8),
          num_extra=st.integers(0, 2 * BLOCK))
    def start(self, conversation: int, namespace: int, num_blocks: int, num_extra: int) -> None:
        tokens = CONVERSATIONS[conversation][: num_blocks * BLOCK]
        keys = block_keys(tokens, BLOCK, NAMESPACES[namespace])
        owner = f"r{self.num_started}"
        self.num_started += 1
        num_pages = -(-(len(tokens) + num_extra) // BLOCK)
        free_before = self.pages.num_free
        shared = self.pages.share_prefix(keys[: num_blocks - 1], owner)
        for i, page in enumerate(shared):  # the matched pages hold exactly this namespace's blocks
            assert self.content[page] == keys[i]
        try:
            own = self.pages.allocate(num_pages - len(shared), owner)
        except PagesExhausted:
            assert num_pages - len(shared) > self.pages.num_free
            self.pages.free_owner(owner)
            assert self.pages.num_free == free_before
            return
        for running in self.running.values():  # nothing another sequence uses was handed out
            assert not set(own) & set(running.own) and not set(own) & set(running.shared)
        for i, page in enumerate(own):  # the sequence computes its blocks past the prefix
            block = len(shared) + i
            self.content[page] = keys[block] if block < len(keys) else b"tail"
        self.running[owner] = Running(keys, shared, own, shared + own)

    @precondition(lambda self: bool(self.running))
    @rule(pick=st.integers(0, 10**6), is_complete=st.booleans())
    def finish(self, pick: int, is_complete: bool) -> None:
        owner = sorted(self.running)[pick % len(self.running)]
        running = self.running.pop(owner)
        if is_complete:
            num = len(running.keys)
            self.pages.keep(owner, list(zip(running.keys, running.page_ids[:num])))
        self.pages.free_owner(owner)

    @invariant()
    def consistent(self) -> None:
        cache = self.pages.cache
        assert cache is not None
        cache.check()
        readers: dict[int, int] = {}
        for owner, running in self.running.items():
            for page in running.shared:
                readers[page] = readers.get(page, 0) + 1
                assert cache.is_cached_page(page)
            for i, page in enumerate(running.shared):  # never evicted and rewritten under a reader
                assert self.content[page] == running.keys[i]
            assert set(self.pages.pages_of(owner)) == set(running.own)
        assert {page: cache.readers_of(page) for page in readers} == readers
        assert cache.num_referenced == len(readers)
        num_own = sum(len(r.own) for r in self.running.values())
        assert self.pages.num_free == NUM_PAGES - num_own - len(readers)
        assert self.pages.num_free >= cache.num_reclaimable


TestPrefixPages = PrefixPages.TestCase
TestPrefixPages.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_repeated_prompt_reads_its_prefix_in_place_and_eviction_takes_the_deepest_block_first() -> None:
    pages = PageAllocator(6, DevicePrefixCache())
    keys = block_keys(list(range(3 * BLOCK)), BLOCK, NAMESPACE)
    first = pages.allocate(3, "a")
    assert pages.keep("a", list(zip(keys, first))) == 3
    pages.free_owner("a")
    assert pages.num_free == 6 and pages.num_cached == 3
    assert pages.share_prefix(keys[:2], "b") == first[:2]
    assert pages.num_free == 4  # two read, one cached page reclaimable, three free
    pages.allocate(4, "c")  # evicts the one unreferenced cached page (block 2)
    assert pages.cache is not None and keys[2] not in pages.cache and keys[0] in pages.cache
    pages.free_owner("b")
    pages.free_owner("c")
    pages.allocate(5, "d")  # evicts block 1 before block 0
    assert keys[1] not in pages.cache and keys[0] in pages.cache
    gained, lost = pages.cache.drain_changes()
    assert gained == [keys[0]] and lost == []  # blocks 1 and 2 came and went between two reports


def test_without_a_cache_nothing_is_shared_or_kept() -> None:
    pages = PageAllocator(4)
    keys = block_keys(list(range(2 * BLOCK)), BLOCK, NAMESPACE)
    own = pages.allocate(2, "a")
    assert pages.keep("a", list(zip(keys, own))) == 0
    pages.free_owner("a")
    assert pages.share_prefix(keys, "b") == [] and pages.num_free == 4
