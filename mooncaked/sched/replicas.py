"""Which copies of each block the pool keeps: the conductor's view of replicas (pure, `now` passed in).

Under `replication: by_reuse`, a block held by several stores has one primary copy: the one on the store of the
prefill instance that last used it (a placement that reused or computed the block there). Its other copies are
spare, given back first by their stores' eviction (`mooncaked.kv.replica_eviction`), unless the block is hot
enough that a second copy pays for its capacity (`pays_to_replicate`): then every copy is kept. Under
`replication: always` (the paper) nothing is ever spare.

1. The owner (the conductor's cluster view, or the simulator) creates `ReplicaTracker(config, index)`; from then
   on it listens to the shadow index for keys whose holders change.
2. Per placement, `note_use(store_id, keys, num_reused, now)`: that store becomes the primary of every key of the
   prompt, and the reused prefix heats up (heat: uses, halved every `heat_half_life_s`).
3. `take_marks(costs, now)` gives, per store, the keys whose copy there became spare and those kept again since
   the last call; the owner applies them (the simulator at once; the conductor by one batched store call per
   store, off the request path). A copy becomes spare only while the primary store holds the key too, so a
   pending fetch or prefill never leaves the pool without a kept copy, and the last copy is always kept.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from mooncaked.sched.predictors import Predictors
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import PolicyConfig


@dataclass(frozen=True)
class BlockCosts:
    """What one block costs to move and to recompute (seconds), from the scheduler's predictors."""

    transfer_s: float
    recompute_s: float

    @classmethod
    def from_predictors(cls, predictors: Predictors, block_size: int) -> BlockCosts:
        return cls(predictors.transfer.predict(1), predictors.prefill.predict(block_size, 0))


def pays_to_replicate(heat: float, costs: BlockCosts, displaced_reuse: float) -> bool:
    """Whether a block with this heat earns a second kept copy.

    A kept replica saves a transfer per use on its store; it takes a block of capacity, whose occupant would have
    been reused with probability `displaced_reuse` and then recomputed. Keep it when heat x transfer time >=
    displaced_reuse x recompute time (heat counts uses in about one half-life).
    """
    return heat * costs.transfer_s >= displaced_reuse * costs.recompute_s


@dataclass
class StoreMarks:
    """Changes for one store: keys whose copy there is now spare, and keys whose copy is kept again."""

    spare: list[Hashable] = field(default_factory=list)
    kept: list[Hashable] = field(default_factory=list)


@dataclass
class _Block:
    primary: str
    used_at: float
    heat: float = 0.0
    heat_at: float = 0.0
    spare_on: frozenset[str] = frozenset()  # the stores last told their copy is spare


class ReplicaTracker:
    """Primary store, heat and spare marks per block. Owner: the conductor's cluster view (or the simulator);
    it reads the shadow index, which stays its owner's."""

    def __init__(self, config: PolicyConfig, index: ShadowIndex) -> None:
        self.config = config
        self.index = index
        self._blocks: dict[Hashable, _Block] = {}
        self._dirty: set[Hashable] = set()
        self._sweep_at = 4096  # number of blocks at which unheld ones are forgotten next
        if self.is_active:
            index.add_listener(self._holders_changed)

    @property
    def is_active(self) -> bool:
        return self.config.replication == "by_reuse"

    def heat(self, key: Hashable, now: float) -> float:
        block = self._blocks.get(key)
        return 0.0 if block is None else self._decayed(block, now)

    def primary(self, key: Hashable) -> str | None:
        block = self._blocks.get(key)
        return None if block is None else block.primary

    def note_use(self, store_id: str, keys: Sequence[Hashable], num_reused: int, now: float) -> None:
        """A placement on `store_id`'s host uses `keys`; the first `num_reused` come from the pool."""
        if not self.is_active:
            return
        for position, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None:
                block = self._blocks[key] = _Block(store_id, now, heat_at=now)
            block.primary, block.used_at = store_id, now
            if position < num_reused:
                block.heat = self._decayed(block, now) + 1.0
                block.heat_at = now
        self._dirty.update(keys)

    def take_marks(self, costs: BlockCosts, now: float) -> dict[str, StoreMarks]:
        """Mark changes per store since the last call (see the module docstring)."""
        if not self.is_active:
            return {}
        dirty, self._dirty = self._dirty, set()
        marks: dict[str, StoreMarks] = {}
        for key in dirty:
            self._update(key, costs, now, marks)
        if len(self._blocks) > self._sweep_at:
            self._forget_unheld(now)
        return marks

    def undo_marks(self, store_id: str, marks: StoreMarks) -> None:
        """The store did not get `marks` (the call failed): they are sent again by a later `take_marks`."""
        for key in marks.spare:
            block = self._blocks.get(key)
            if block is not None:
                block.spare_on = block.spare_on - {store_id}
        for key in marks.kept:
            block = self._blocks.get(key)
            if block is not None:
                block.spare_on = block.spare_on | {store_id}
        self._dirty.update(marks.spare)
        self._dirty.update(marks.kept)

    def _holders_changed(self, store_id: str, keys: Sequence[Hashable], is_stored: bool) -> None:
        self._dirty.update(keys)
        if not is_stored:  # a dropped copy drops its mark: a copy stored there again starts kept
            for key in keys:
                block = self._blocks.get(key)
                if block is not None and store_id in block.spare_on:
                    block.spare_on = block.spare_on - {store_id}

    def _update(self, key: Hashable, costs: BlockCosts, now: float, marks: dict[str, StoreMarks]) -> None:
        block = self._blocks.get(key)
        if block is None:
            return  # never used by a placement: every copy stays kept
        holders = self.index.holders(key)
        spare_on: frozenset[str] = frozenset()
        if len(holders) > 1 and block.primary in holders:
            if not pays_to_replicate(self._decayed(block, now), costs, self.config.replica_displaced_reuse):
                spare_on = frozenset(h for h in holders if h != block.primary)
        told = block.spare_on
        for store_id in spare_on - told:
            marks.setdefault(store_id, StoreMarks()).spare.append(key)
        for store_id in told - spare_on:
            marks.setdefault(store_id, StoreMarks()).kept.append(key)
        block.spare_on = spare_on

    def _decayed(self, block: _Block, now: float) -> float:
        age_s = max(now - block.heat_at, 0.0)
        return block.heat * 0.5 ** (age_s / self.config.heat_half_life_s)

    def _forget_unheld(self, now: float) -> None:
        """Forget blocks no store holds (evicted everywhere, or placed and never stored) unless used lately: a
        prefill may still be queued. Memory stays O(keys in the index + keys of recent prompts)."""
        horizon = now - 10 * self.config.heat_half_life_s
        index = self.index
        self._blocks = {key: block for key, block in self._blocks.items()
                        if block.used_at >= horizon or index.has_key(key)}
        self._sweep_at = max(2 * len(self._blocks), 4096)
