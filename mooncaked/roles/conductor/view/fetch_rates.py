"""Measured rates of prefix fetches between hosts, for Algorithm 1's transfer-time estimate.

1. After a PREFILL that fetched blocks from another host's store, `observe(prefill instance, store, bytes,
   seconds)` folds the fetch's rate into that pair's moving average (the load's seconds bound the link's time
   from above, so the rate is a lower bound of the link's).
2. `for_instance(name)` gives the placer the measured (store, bytes per second) pairs into that instance; a
   pair never measured keeps the configured `scheduler.link_gbps`.
3. `forget(name)` drops an instance's or store's pairs when it leaves the cluster.
"""

from __future__ import annotations

SMOOTHING = 0.5  # weight of the newest fetch: a link that slows down shows within a few fetches


class FetchRates:
    """Owns the moving average of bytes per second per (prefill instance, source store)."""

    def __init__(self) -> None:
        self._rates: dict[tuple[str, str], float] = {}

    def observe(self, instance: str, store: str, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        old = self._rates.get((instance, store))
        self._rates[(instance, store)] = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old

    def for_instance(self, instance: str) -> tuple[tuple[str, float], ...]:
        return tuple(sorted((store, rate) for (name, store), rate in self._rates.items() if name == instance))

    def forget(self, name: str) -> None:
        self._rates = {pair: rate for pair, rate in self._rates.items() if name not in pair}
