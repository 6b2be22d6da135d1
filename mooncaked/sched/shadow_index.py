"""The conductor's shadow copy of which store holds which block key (paper section 5.3).

1. At start, and whenever it reports a store as needing a resync, the owner asks that store for a full dump
   and calls `apply_dump(store_id, seq, keys)`.
2. Store events arrive with a per-store sequence number: `apply_stored` / `apply_removed`. An event whose
   sequence number is not the next one is not applied; the store is marked stale (listed by `stale_stores`)
   until its next dump. Old or repeated sequence numbers are ignored (at-least-once delivery is fine).
3. `prefix_lengths(keys)` answers, for every store holding at least the first key, how many leading keys it
   holds: one walk over the keys with a bitset of the stores still matching, O(len(keys)) set operations.
4. Listeners added with `add_listener` hear of every change as (store id, keys, is_stored): the keys that store
   just gained (True) or lost (False). The replica tracker and the store recency of `mooncaked.sched` listen.

The index owns the key -> stores bitsets and the per-store key sets; the stores own the truth. Stale data is
still used for scheduling (a wrong guess costs a slower prefill, never a wrong answer: the store re-checks).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

IndexListener = Callable[[str, Sequence[Hashable], bool], None]


class ShadowIndex:
    """Key -> bitset of store slots. Owner: the conductor (or the simulator)."""

    def __init__(self) -> None:
        self._holders: dict[Hashable, int] = {}
        self._store_keys: dict[str, set[Hashable]] = {}
        self._slot_of: dict[str, int] = {}
        self._store_of_slot: list[str | None] = []
        self._last_seq: dict[str, int] = {}
        self._stale: set[str] = set()
        self._listeners: list[IndexListener] = []

    @property
    def num_keys(self) -> int:
        return len(self._holders)

    def stores(self) -> list[str]:
        return list(self._slot_of)

    def add_listener(self, listener: IndexListener) -> None:
        """`listener(store_id, keys, is_stored)` after each change: keys the store gained, or lost."""
        self._listeners.append(listener)

    def stale_stores(self) -> set[str]:
        """Stores that must send a full dump (never dumped, or a gap was seen)."""
        return set(self._stale)

    def num_blocks(self, store_id: str) -> int:
        return len(self._store_keys.get(store_id, ()))

    def add_store(self, store_id: str) -> None:
        """Registers a store with no keys, stale until its first dump."""
        if store_id in self._slot_of:
            return
        slot = len(self._store_of_slot)
        for index, owner in enumerate(self._store_of_slot):
            if owner is None:
                slot = index
                break
        if slot == len(self._store_of_slot):
            self._store_of_slot.append(store_id)
        else:
            self._store_of_slot[slot] = store_id
        self._slot_of[store_id] = slot
        self._store_keys[store_id] = set()
        self._stale.add(store_id)

    def remove_store(self, store_id: str) -> None:
        """Forgets a store (it left the cluster) and all its keys."""
        if store_id not in self._slot_of:
            return
        self._drop_keys(store_id, list(self._store_keys[store_id]))
        slot = self._slot_of.pop(store_id)
        self._store_of_slot[slot] = None
        del self._store_keys[store_id]
        self._last_seq.pop(store_id, None)
        self._stale.discard(store_id)

    def apply_dump(self, store_id: str, seq: int, keys: Iterable[Hashable]) -> None:
        """Replaces the store's key set with a full dump taken at sequence number `seq`."""
        self.add_store(store_id)
        new_keys = set(keys)
        old_keys = self._store_keys[store_id]
        self._drop_keys(store_id, [key for key in old_keys if key not in new_keys])
        self._add_keys(store_id, [key for key in new_keys if key not in old_keys])
        self._last_seq[store_id] = seq
        self._stale.discard(store_id)

    def last_seq(self, store_id: str) -> int:
        """The sequence number of the store's last applied dump or event; -1 while it is unknown or stale."""
        if store_id in self._stale or store_id not in self._last_seq:
            return -1
        return self._last_seq[store_id]

    def apply_changes(self, store_id: str, from_seq: int, to_seq: int, gained: Sequence[Hashable],
                      lost: Sequence[Hashable]) -> bool:
        """The net change from `from_seq` to `to_seq` (an instance's device prefix cache reports these); False,
        and the store stale, when `from_seq` is not the last one applied."""
        if self.last_seq(store_id) != from_seq or to_seq < from_seq:
            self.add_store(store_id)
            self._stale.add(store_id)
            return False
        self._drop_keys(store_id, lost)
        self._add_keys(store_id, gained)
        self._last_seq[store_id] = to_seq
        return True

    def apply_stored(self, store_id: str, seq: int, keys: Sequence[Hashable]) -> bool:
        """A BlockStored event. False when it reveals a gap: the store now needs a resync."""
        if not self._accept(store_id, seq):
            return store_id not in self._stale
        self._add_keys(store_id, keys)
        return True

    def apply_removed(self, store_id: str, seq: int, keys: Sequence[Hashable]) -> bool:
        """A BlockRemoved event. False when it reveals a gap: the store now needs a resync."""
        if not self._accept(store_id, seq):
            return store_id not in self._stale
        self._drop_keys(store_id, keys)
        return True

    def holders(self, key: Hashable) -> list[str]:
        mask = self._holders.get(key, 0)
        return [store for store in self._stores_in(mask)]

    def holds(self, store_id: str, key: Hashable) -> bool:
        """True when `store_id` holds `key`."""
        return key in self._store_keys.get(store_id, ())

    def has_key(self, key: Hashable) -> bool:
        """True when at least one store holds `key`."""
        return key in self._holders

    @property
    def num_copies(self) -> int:
        """Copies held over all stores (a key held by three stores counts three)."""
        return sum(len(keys) for keys in self._store_keys.values())

    def prefix_lengths(self, keys: Sequence[Hashable]) -> dict[str, int]:
        """Leading keys held, for every store holding keys[0]; stores absent from the result hold none."""
        if not keys:
            return {}
        holders = self._holders
        mask = holders.get(keys[0], 0)
        lengths: dict[str, int] = {}
        for position in range(1, len(keys)):
            if not mask:
                return lengths
            next_mask = mask & holders.get(keys[position], 0)
            if next_mask != mask:
                for store in self._stores_in(mask & ~next_mask):
                    lengths[store] = position
                mask = next_mask
        for store in self._stores_in(mask):
            lengths[store] = len(keys)
        return lengths

    def _accept(self, store_id: str, seq: int) -> bool:
        """True when `seq` is the next event of a fresh store; marks the store stale on a gap."""
        if store_id not in self._slot_of:
            self.add_store(store_id)
            return False
        if store_id in self._stale:
            return False
        last = self._last_seq[store_id]
        if seq <= last:
            return False
        if seq != last + 1:
            self._stale.add(store_id)
            return False
        self._last_seq[store_id] = seq
        return True

    def _add_keys(self, store_id: str, keys: Iterable[Hashable]) -> None:
        bit = 1 << self._slot_of[store_id]
        owned = self._store_keys[store_id]
        holders = self._holders
        added = [key for key in keys if key not in owned]
        for key in added:
            holders[key] = holders.get(key, 0) | bit
            owned.add(key)
        self._notify(store_id, added, True)

    def _drop_keys(self, store_id: str, keys: Iterable[Hashable]) -> None:
        bit = 1 << self._slot_of[store_id]
        owned = self._store_keys[store_id]
        holders = self._holders
        dropped = [key for key in keys if key in owned]
        for key in dropped:
            owned.discard(key)
            mask = holders[key] & ~bit
            if mask:
                holders[key] = mask
            else:
                del holders[key]
        self._notify(store_id, dropped, False)

    def _notify(self, store_id: str, keys: list[Hashable], is_stored: bool) -> None:
        if keys:
            for listener in self._listeners:
                listener(store_id, keys, is_stored)

    def _stores_in(self, mask: int) -> list[str]:
        stores: list[str] = []
        while mask:
            low_bit = mask & -mask
            owner = self._store_of_slot[low_bit.bit_length() - 1]
            if owner is not None:
                stores.append(owner)
            mask ^= low_bit
        return stores
