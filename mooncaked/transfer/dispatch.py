"""Slicing and dispatch: pieces of requests waiting for a path to one peer.

1. `make_pieces` turns a request into one pending piece (its slices, not yet cut).
2. Path workers (threads, one per path) `take` a run of whole slices from the first piece they may carry:
   a path is eligible when it is usable (not cooling down), the piece has not failed on it (unless it has failed
   on every usable path) and no usable path has a better topology tier for this piece.
3. A worker reports `succeed`, `retry` (path error: the run goes back at the front, for another path) or
   `reject` (the remote refused it: the batch fails). Retries are bounded by `max_retries` per piece. A worker
   that connects only once `has_work` says a run waits reports a failed connection with `fail_path`: it counts
   against the path, no run is charged.
4. When every path to the peer is cooling down, pending pieces fail at once instead of waiting.
5. Failure domains: paths that fail together (the connections over one NIC pair) share one health record, so
   one failure cools the whole pair down and a retried piece avoids every path of the pair it failed on. By
   default each path is its own domain.
6. A queue may start without paths (its link is still learning the peer's NICs): pieces wait until
   `set_paths`. `tiers_for(location)` ranks the paths for a piece's local memory location when the piece
   carries no `path_tiers` of its own.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from mooncaked.transfer.batch import BatchRecord
from mooncaked.transfer.paths import PathHealth
from mooncaked.transfer.types import TransferOp


_NO_BYTES = memoryview(bytearray())


@dataclass(eq=False)
class Piece:
    """A contiguous part of one request, made of whole slices; mutated only under its PeerQueue's lock."""

    batch: BatchRecord
    request_index: int
    op: TransferOp
    local_view: memoryview  # exactly `length` bytes of the local segment
    remote_name: str
    remote_offset: int
    length: int
    run_bytes: int  # most bytes one worker takes at once; a multiple of the slice size
    path_tiers: dict[str, int] | None = None  # 0 = preferred; None = every path of the peer, equal
    num_attempts: int = 0
    failed_paths: frozenset[str] = frozenset()
    local_segment: str = ""  # name of the segment `local_view` lies in (RDMA looks up its memory region)
    location: str = ""  # where the local memory is ("cpu:N", "cuda:N"), for tiers_for

    def split_head(self, num_bytes: int) -> Piece:
        """Cut off and return the first `num_bytes`; self keeps the rest."""
        head = replace(self, local_view=self.local_view[:num_bytes], length=num_bytes)
        self.local_view = self.local_view[num_bytes:]
        self.remote_offset += num_bytes
        self.length -= num_bytes
        return head


def run_bytes_for(length: int, slice_bytes: int, num_paths: int, max_run_bytes: int) -> int:
    """Spread one request over all paths: about length/num_paths, in whole slices, within [slice, max_run]."""
    share = -(-length // max(num_paths, 1))
    share = -(-share // slice_bytes) * slice_bytes
    return max(slice_bytes, min(share, max(max_run_bytes, slice_bytes)))


class PeerQueue:
    """Owns the pending pieces for one peer and that peer's PathHealth; thread-safe."""

    def __init__(
        self,
        peer: str,
        paths: Iterable[str],
        health: PathHealth,
        max_retries: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.peer = peer
        self.paths = list(paths)
        self.health = health
        self.max_retries = max_retries
        self._clock = clock
        self._default_tiers = {path: 0 for path in self.paths}
        self._domains: dict[str, str] = {}
        self._num_failures: collections.Counter[str] = collections.Counter()  # by domain, ever
        self._tiers_for: Callable[[str], dict[str, int]] | None = None
        self._pending: collections.deque[Piece] = collections.deque()
        self._cond = threading.Condition()
        self._closed_error: str | None = None

    def set_paths(self, paths: Iterable[str], domains: Mapping[str, str] | None = None,
                  tiers_for: Callable[[str], dict[str, int]] | None = None) -> None:
        """Replace the paths (once a link knows them); `domains` maps a path to its failure domain."""
        with self._cond:
            self.paths = list(paths)
            self._default_tiers = {path: 0 for path in self.paths}
            self._domains = dict(domains or {})
            self._tiers_for = tiers_for
            if not self._any_usable(self._clock()):
                self._fail_pending_locked(None, "no path")
            self._cond.notify_all()

    def domain(self, path: str) -> str:
        return self._domains.get(path, path)

    def num_failures(self, path: str) -> int:
        """Failures ever recorded on `path`'s domain: a connection made before the latest one may be dead too
        (a pulled cable fails every connection of its NIC, each only when it next moves bytes)."""
        with self._cond:
            return self._num_failures[self.domain(path)]

    def put(self, pieces: Iterable[Piece]) -> None:
        with self._cond:
            if self._closed_error is not None:
                for piece in pieces:
                    piece.batch.fail(self._closed_error)
                return
            if not self._any_usable(self._clock()):
                for piece in pieces:
                    piece.batch.fail(self._unreachable_message(piece))
                return
            self._pending.extend(pieces)
            self._cond.notify_all()

    def take(self, path: str, timeout_s: float) -> Piece | None:
        """The next run for `path`, or None after `timeout_s` or once closed."""
        return self._wait_eligible(path, timeout_s, is_taken=True)

    def has_work(self, path: str, timeout_s: float) -> bool:
        """Whether `path` is usable and a run waits for it, within `timeout_s` (nothing is taken)."""
        return self._wait_eligible(path, timeout_s, is_taken=False) is not None

    def fail_path(self, path: str, error: str) -> None:
        """A failure of `path` that held no run (its connection failed); fails the pending pieces when no path
        is usable any more."""
        with self._cond:
            now = self._clock()
            self.health.record_failure(self.domain(path), now, error)
            self._num_failures[self.domain(path)] += 1
            if not self._any_usable(now):
                self._fail_pending_locked(None, error)
            self._cond.notify_all()

    def _wait_eligible(self, path: str, timeout_s: float, is_taken: bool) -> Piece | None:
        deadline = self._clock() + timeout_s
        with self._cond:
            while self._closed_error is None:
                now = self._clock()
                if self.health.is_usable(self.domain(path), now):
                    piece = self._pop_eligible(path, now, is_taken)
                    if piece is not None:
                        return piece
                    wake_at = deadline
                else:
                    wake_at = min(deadline, self.health.cooldown_until(self.domain(path)))
                if now >= deadline:
                    return None
                self._cond.wait(max(wake_at - now, 0.001))
        return None

    def succeed(self, path: str, piece: Piece) -> None:
        with self._cond:
            self.health.record_success(self.domain(path))
        piece.local_view = _NO_BYTES  # no reference to caller memory outlives the batch's completion
        piece.batch.add_done(piece.length)

    def retry(self, path: str, piece: Piece, error: str) -> None:
        with self._cond:
            now = self._clock()
            domain = self.domain(path)
            self.health.record_failure(domain, now, error)
            self._num_failures[domain] += 1
            piece.num_attempts += 1
            piece.failed_paths = piece.failed_paths | {p for p in self.paths if self.domain(p) == domain} | {path}
            if piece.num_attempts > self.max_retries:
                piece.batch.fail(
                    f"request {piece.request_index} to {self.peer}: {error} "
                    f"(gave up after {piece.num_attempts} attempts)"
                )
            elif not self._any_usable(now):
                self._fail_pending_locked(piece, error)
            else:
                self._pending.appendleft(piece)
                self._cond.notify_all()

    def reject(self, piece: Piece, error: str) -> None:
        piece.batch.fail(f"request {piece.request_index}: {error}")

    def close(self, error: str) -> None:
        with self._cond:
            self._closed_error = error
            for piece in self._pending:
                piece.batch.fail(error)
            self._pending.clear()
            self._cond.notify_all()

    def path_states(self) -> dict[str, bool]:
        """Each path and whether it is usable now (False while cooling down)."""
        with self._cond:
            now = self._clock()
            return {path: self.health.is_usable(self.domain(path), now) for path in self.paths}

    def num_pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def _fail_pending_locked(self, piece: Piece | None, error: str) -> None:
        for pending in [*([piece] if piece is not None else []), *self._pending]:
            pending.batch.fail(f"{self._unreachable_message(pending)}; last error: {error}")
        self._pending.clear()

    def _unreachable_message(self, piece: Piece) -> str:
        return (
            f"request {piece.request_index}: no usable path to {self.peer}: "
            f"all {len(self.paths)} paths failed recently and are cooling down"
        )

    def _any_usable(self, now: float) -> bool:
        """Whether some path may carry a piece now; a queue without paths yet is waiting for them."""
        return not self.paths or any(self.health.is_usable(self.domain(path), now) for path in self.paths)

    def _pop_eligible(self, path: str, now: float, is_taken: bool = True) -> Piece | None:
        index = 0
        while index < len(self._pending):
            piece = self._pending[index]
            if piece.batch.is_finished:
                del self._pending[index]
                continue
            if self._is_eligible(piece, path, now):
                if not is_taken:
                    return piece
                if piece.length > piece.run_bytes:
                    return piece.split_head(piece.run_bytes)
                del self._pending[index]
                return piece
            index += 1
        return None

    def _is_eligible(self, piece: Piece, path: str, now: float) -> bool:
        tiers = piece.path_tiers
        if tiers is None:
            tiers = self._tiers_for(piece.location) if self._tiers_for is not None else self._default_tiers
        if path not in tiers:
            return False
        usable = [p for p in tiers if self.health.is_usable(self.domain(p), now) and p not in piece.failed_paths]
        if not usable:
            usable = [p for p in tiers if self.health.is_usable(self.domain(p), now)]
        return path in usable and tiers[path] == min(tiers[p] for p in usable)
