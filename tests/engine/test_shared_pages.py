"""A parallel sampling's sequences holding their prompt's pages together (PageAllocator.share), beside the device
prefix cache, under random interleavings of starts, ends and cancels (hypothesis state machine): no page is freed
or handed to another request while any sequence still holds or reads it, and a page is free once every sequence
that held it ended."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncaked.engine.page_allocator import PageAllocator, PagesExhausted
from mooncaked.kv.device_cache import DevicePrefixCache
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.sched.decode_memory import num_pages_for

BLOCK = 4
NUM_PAGES = 40
NAMESPACE = model_namespace("m", "float32", BLOCK, "gqa")
PROMPTS = [[(p * 31 + i * 7) % 50 for i in range(6 * BLOCK)] for p in range(2)]


@dataclass
class Sequence:
    family: int
    keys: list[bytes]
    page_ids: list[int]


class SharedPages(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pages = PageAllocator(NUM_PAGES, DevicePrefixCache())
        self.content: dict[int, object] = {}  # page -> what was written into it (a block key or a private tag)
        self.running: dict[str, Sequence] = {}
        self.num_families = 0

    @rule(prompt=st.integers(0, 1), num_tokens=st.integers(1, 6 * BLOCK), num_extra=st.integers(1, 3 * BLOCK),
          num_seqs=st.integers(1, 4))
    def start(self, prompt: int, num_tokens: int, num_extra: int, num_seqs: int) -> None:
        family = self.num_families
        self.num_families += 1
        tokens = PROMPTS[prompt][:num_tokens]
        keys = block_keys(tokens, BLOCK, NAMESPACE)
        num_full = len(keys)
        num_pages = -(-(num_tokens + num_extra) // BLOCK)
        free_before = self.pages.num_free
        owners = [f"f{family}#{q}" for q in range(num_seqs)]
        taken: set[int] = set()
        try:
            shared = self.pages.share_prefix(keys, owners[0])
            first = shared + self.pages.allocate(num_pages - len(shared), owners[0])
            page_ids = [first]
            for owner in owners[1:]:
                self.pages.share(first[:num_full], owners[0], owner)
                page_ids.append(first[:num_full] + self.pages.allocate(num_pages - num_full, owner))
        except PagesExhausted:
            for owner in owners:
                self.pages.free_owner(owner)
            assert self.pages.num_free == free_before
            return
        for seq_pages in page_ids:  # nothing another running sequence uses was handed out
            own = seq_pages[len(shared):]
            taken |= set(own)
            assert not any(set(own) & set(r.page_ids) for r in self.running.values())
        assert len(taken | set(shared)) == num_pages_for(num_tokens, num_extra, BLOCK, num_seqs)
        for q, seq_pages in enumerate(page_ids):  # the first writes the prompt, each its own tail and output
            start = len(shared) if q == 0 else num_full
            for i, page in enumerate(seq_pages[start:], start):
                self.content[page] = keys[i] if i < num_full else (family, q, i)
        for owner, seq_pages in zip(owners, page_ids):
            self.running[owner] = Sequence(family, keys, seq_pages)

    @precondition(lambda self: bool(self.running))
    @rule(pick=st.integers(0, 10**6), is_complete=st.booleans())
    def end(self, pick: int, is_complete: bool) -> None:
        owner = sorted(self.running)[pick % len(self.running)]
        seq = self.running.pop(owner)
        if is_complete:
            self.pages.keep(owner, list(zip(seq.keys, seq.page_ids)))
        self.pages.free_owner(owner)

    @precondition(lambda self: bool(self.running))
    @rule(pick=st.integers(0, 10**6))
    def cancel_family(self, pick: int) -> None:
        families = sorted({s.family for s in self.running.values()})
        family = families[pick % len(families)]
        for owner in [o for o, s in self.running.items() if s.family == family]:
            del self.running[owner]
            self.pages.free_owner(owner)

    @invariant()
    def held_pages_are_never_freed(self) -> None:
        cache = self.pages.cache
        assert cache is not None
        cache.check()
        in_use: set[int] = set()
        for owner, seq in self.running.items():
            for i, page in enumerate(seq.page_ids):
                assert owner in self.pages.holders_of(page) or cache.readers_of(page) > 0
                if i < len(seq.keys):  # a prompt block: its KV is still there for every sequence reading it
                    assert self.content[page] == seq.keys[i]
            in_use |= set(seq.page_ids)
        assert self.pages.num_free == NUM_PAGES - len(in_use)
        if not self.running:
            assert self.pages.num_used == 0 and cache.num_referenced == 0


TestSharedPages = SharedPages.TestCase
TestSharedPages.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


def test_a_shared_page_is_freed_by_its_last_holder_and_cached_only_by_it() -> None:
    pages = PageAllocator(8, DevicePrefixCache())
    keys = block_keys(list(range(2 * BLOCK)), BLOCK, NAMESPACE)
    first = pages.allocate(3, "r")
    pages.share(first[:2], "r", "r#1")
    second = first[:2] + pages.allocate(1, "r#1")
    assert pages.num_used == 4 and pages.holders_of(first[0]) == ["r", "r#1"]
    assert pages.keep("r", list(zip(keys, first))) == 0  # still held by r#1: not the cache's yet
    pages.free_owner("r")
    assert pages.num_used == 3 and pages.holders_of(first[0]) == ["r#1"]
    assert pages.keep("r#1", list(zip(keys, second))) == 2
    pages.free_owner("r#1")
    assert pages.num_used == 0 and pages.num_cached == 2


def test_sharing_what_the_owner_does_not_hold_is_refused() -> None:
    pages = PageAllocator(4)
    held = pages.allocate(2, "a")
    other = pages.allocate(1, "b")
    with pytest.raises(ValueError, match="neither held nor read by 'a'"):
        pages.share([held[0], other[0]], "a", "c")
    assert pages.holders_of(held[0]) == ["a"] and pages.pages_of("c") == []
    pages.share(held, "a", "c")
    with pytest.raises(ValueError, match="held by 'c' already"):
        pages.share(held, "a", "c")
    assert pages.transfer("a", "d") == []  # shared pages never change hands
