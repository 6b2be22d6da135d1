"""The pool-wide policies a conductor runs beside Algorithm 1, on the simulator's stores (the same `sched/` code).

1. `PoolPolicies(config, index, predictors)` holds the replica tracker under `scheduler.replication: by_reuse`
   and the store recency under `tie_break: coldest_store` (`mooncaked.sched.replicas`, `.store_recency`); with
   the paper's settings it holds neither and every call below does nothing.
2. Per placement the engine calls `note_use(store_id, keys, num_reused, now)`; the prefill views read
   `coldest_use(store_id)`.
3. After every event, `apply_marks(stores, now)` hands the tracker's spare marks to the stores at once (the
   conductor sends them in background batches).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from mooncaked.sched.predictors import Predictors
from mooncaked.sched.replicas import BlockCosts, ReplicaTracker
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.store_recency import StoreRecency
from mooncaked.sched.types import PolicyConfig
from mooncaked.sim.cluster import HostStore


class PoolPolicies:
    """Owns the replica tracker and the store recency of one run; the engine owns the index and the stores."""

    def __init__(self, config: PolicyConfig, index: ShadowIndex, predictors: Predictors) -> None:
        self.replicas = ReplicaTracker(config, index) if config.replication == "by_reuse" else None
        self.recency = StoreRecency(index) if config.tie_break == "coldest_store" else None
        self.costs = BlockCosts.from_predictors(predictors, config.block_size)  # fixed: the cost model's

    @property
    def is_replica_aware(self) -> bool:
        return self.replicas is not None

    def note_use(self, store_id: str, keys: Sequence[Hashable], num_reused: int, now: float) -> None:
        if self.replicas is not None:
            self.replicas.note_use(store_id, keys, num_reused, now)
        if self.recency is not None:
            self.recency.note_use(store_id, keys, now)

    def coldest_use(self, store_id: str) -> float:
        return self.recency.coldest_use(store_id) if self.recency is not None else 0.0

    def apply_marks(self, stores: Mapping[str, HostStore], now: float) -> None:
        if self.replicas is not None:
            for store_id, marks in self.replicas.take_marks(self.costs, now).items():
                stores[store_id].apply_marks(marks)
