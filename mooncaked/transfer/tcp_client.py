"""TCP transport, client side: several data connections to one peer, each driven by its own thread.

1. `TcpPeerLink.start` starts one worker thread per connection (path "tcp:<endpoint>#<i>"). A worker connects,
   with the client side of the handshake (handshake.py), once its path has work and before it takes any: a path
   that cannot connect holds no run, it only counts a failure. A connection idle for half of `idle_timeout_s` is
   closed and made anew before its next frame, so the server, which closes connections idle for
   `idle_timeout_s`, never closes one under a frame.
2. A worker takes a run of slices from the peer's queue and sends one frame: WRITE sends the header and the
   local segment's memoryview in one `sendmsg`; READ receives the payload with `recv_into` straight into the
   local segment. No intermediate copies. Up to two frames are outstanding per connection.
3. A socket error closes that connection and hands the run back for another path; a refusal from the server
   (of a frame, or of the handshake) fails the batch. `stop` closes the queue, shuts sockets down and joins the
   threads within a deadline.
4. Multi-NIC (the engine has `nics`): `start` first learns the peer's NICs from one handshake (nics.py's
   advertisement), then makes the paths: for every NIC pair with a link (`nic_pairs`), about
   num_connections_per_peer / pairs connections, bound to the local NIC's address and connected to the remote
   NIC's ("tcp:<endpoint>@<local>><remote>#<i>"). Each NIC pair is one failure domain of the PeerQueue: a
   failure cools the pair down and its runs go to the other pairs; after the cooldown the pair is tried again,
   so a NIC that comes back carries slices again. A peer that advertises no NICs, shares no subnet, or cannot
   be reached for the first handshake gets the plain paths of 1. An idle connection whose pair failed since it
   was made is made anew before it carries a run (it may be as dead as the one that failed). Runs go to the
   NIC pairs whose local NIC serves the run's memory (`serving_tier`), to the others only when none of those
   is usable.
"""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass

from mooncaked.transfer import wire
from mooncaked.transfer.dispatch import PeerQueue, Piece
from mooncaked.transfer.handshake import DataCredentials, client_handshake
from mooncaked.transfer.nics import Nic, nic_pairs, serving_tier
from mooncaked.transfer.options import TransferOptions
from mooncaked.transfer.paths import PathHealth
from mooncaked.transfer.types import TransferOp, split_endpoint

_TAKE_POLL_S = 0.25
# Frames outstanding per connection: the next frame is on the wire while the previous reply is awaited, so a
# connection never idles for a round trip. A WRITE is never sent while a READ is outstanding on the connection
# (both sides would be blocked sending payloads): every other mix has a small message in one direction.
_PIPELINE_DEPTH = 2
InFlight = collections.deque[tuple[int, Piece]]  # (frame tag, piece), oldest first
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Route:
    """Where one path's connection goes, and from which local address (None: as the kernel routes)."""

    destination: tuple[str, int]
    source: str | None = None
    local_nic: Nic | None = None


class TcpPeerLink:
    """Owns one peer's PeerQueue, its paths' routes, connection sockets and threads (workers, NIC discovery)."""

    def __init__(self, endpoint: str, options: TransferOptions, credentials: DataCredentials) -> None:
        self.endpoint = endpoint
        self._credentials = credentials
        self._address = split_endpoint(endpoint)
        self._options = options
        health = PathHealth(options.path_failure_threshold, options.path_cooldown_s)
        self.queue = PeerQueue(endpoint, [], health, options.max_retries)
        self._routes: dict[str, _Route] = {}
        self._tiers_by_location: dict[str, dict[str, int]] = {}
        self._connect_timeout_s = options.connect_timeout_s
        self._io_timeout_s = options.io_timeout_s
        self._reuse_limit_s = options.idle_timeout_s / 2
        self._send_buffer_bytes = options.tcp_send_buffer_bytes
        self._sockets: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self._is_stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def paths(self) -> list[str]:
        return self.queue.paths

    def start(self) -> None:
        if self._options.nics:
            self._spawn(self._discover, f"rdma-nics-{self.endpoint}")
        else:
            self._use_routes(self._plain_routes(), {})

    def stop(self, timeout_s: float) -> None:
        self._is_stopping.set()
        self.queue.close(f"transfer engine stopped; link to {self.endpoint} closed")
        with self._lock:
            sockets = list(self._sockets.values())
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))

    def _spawn(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            if self._is_stopping.is_set():
                return
            self._threads.append(thread)
        thread.start()

    def _plain_routes(self) -> dict[str, _Route]:
        return {f"tcp:{self.endpoint}#{i}": _Route(self._address)
                for i in range(self._options.num_connections_per_peer)}

    def _discover(self) -> None:
        """Learn the peer's NICs from one handshake, then make a path set over every NIC pair with a link."""
        peer_nics: list[Nic] = []
        try:
            with socket.create_connection(self._address, timeout=self._connect_timeout_s) as sock:
                wire.set_io_timeout(sock, self._io_timeout_s)
                peer_nics = client_handshake(sock, self._credentials, self.endpoint)
        except OSError as exc:  # the plain paths will report it (HandshakeRefused is an OSError too)
            logger.warning("cannot learn the NICs of %s (%s): using its address only", self.endpoint, exc)
        pairs = nic_pairs(self._options.nics, peer_nics)
        if not pairs:
            self._use_routes(self._plain_routes(), {})
            return
        num_per_pair = -(-self._options.num_connections_per_peer // len(pairs))
        routes, domains = {}, {}
        for mine, theirs in pairs:
            domain = f"tcp:{self.endpoint}@{mine.name}>{theirs.name}"
            for i in range(num_per_pair):
                routes[f"{domain}#{i}"] = _Route((theirs.address, self._address[1]), mine.address, mine)
                domains[f"{domain}#{i}"] = domain
        logger.info("transfers to %s go over %d NIC pairs: %s", self.endpoint, len(pairs),
                    ", ".join(f"{mine.name}>{theirs.name}" for mine, theirs in pairs))
        self._use_routes(routes, domains)

    def _use_routes(self, routes: dict[str, _Route], domains: dict[str, str]) -> None:
        self._routes = routes
        is_ranked = any(route.local_nic is not None for route in routes.values())
        self.queue.set_paths(routes, domains, self._tiers_for if is_ranked else None)
        for path in routes:
            self._spawn(self._run_worker, f"rdma-{path}", path)

    def _tiers_for(self, location: str) -> dict[str, int]:
        """Each path's tier for memory at `location` (called under the queue's lock)."""
        tiers = self._tiers_by_location.get(location)
        if tiers is None:
            tiers = {path: serving_tier(route.local_nic, location) if route.local_nic is not None else 0
                     for path, route in self._routes.items()}
            self._tiers_by_location[location] = tiers
        return tiers

    def _run_worker(self, path: str) -> None:
        sock: socket.socket | None = None
        last_used = 0.0
        in_flight: InFlight = collections.deque()
        tags = itertools.count(1)
        num_failures_at_connect = 0
        while not self._is_stopping.is_set():
            if sock is not None and not in_flight and (
                    time.monotonic() - last_used > self._reuse_limit_s  # the server may close it any moment now
                    or self.queue.num_failures(path) != num_failures_at_connect):  # its NIC pair failed since
                self._close(path, sock)
                sock = None
            if sock is None:
                if not self.queue.has_work(path, _TAKE_POLL_S):
                    continue
                num_failures_at_connect = self.queue.num_failures(path)
                sock = self._connect_for_work(path)  # before taking a run: a dead path holds none
                last_used = time.monotonic()
                continue
            piece = self.queue.take(path, 0.0 if in_flight else _TAKE_POLL_S)
            try:
                if piece is None:
                    if in_flight:
                        self._complete_oldest(sock, path, in_flight)
                        last_used = time.monotonic()
                    continue
                if piece.op is TransferOp.WRITE:
                    while any(p.op is TransferOp.READ for _, p in in_flight):
                        self._complete_oldest(sock, path, in_flight)
                in_flight.append((next(tags), piece))
                _send_frame(sock, piece, in_flight[-1][0])
                if len(in_flight) >= _PIPELINE_DEPTH:
                    self._complete_oldest(sock, path, in_flight)
                last_used = time.monotonic()
            except OSError as exc:
                self._close(path, sock)
                sock = None
                for failed_piece in _take_failed(in_flight, piece):
                    self.queue.retry(path, failed_piece, f"{path}: {type(exc).__name__}: {exc}")
        self._close(path, sock)

    def _connect_for_work(self, path: str) -> socket.socket | None:
        """A connection for `path`, or None: a failure counts against the path (its runs stay queued for
        others); a refused handshake fails a run of the path (another path cannot help)."""
        try:
            return self._connect(path)
        except wire.RemoteRejected as exc:
            piece = self.queue.take(path, 0.0)
            if piece is not None:
                self.queue.reject(piece, str(exc))
        except OSError as exc:
            self.queue.fail_path(path, f"{path}: {type(exc).__name__}: {exc}")
        return None

    def _complete_oldest(self, sock: socket.socket | None, path: str, in_flight: InFlight) -> None:
        assert sock is not None, "frames are in flight only on a connected socket"
        tag, piece = in_flight[0]
        self._complete_frame(sock, path, tag, piece)
        in_flight.popleft()

    def _complete_frame(self, sock: socket.socket, path: str, tag: int, piece: Piece) -> None:
        try:
            _receive_reply(sock, piece, tag)
        except wire.RemoteRejected as exc:
            self.queue.reject(piece, f"{self.endpoint} refused: {exc}")
        else:
            self.queue.succeed(path, piece)

    def _connect(self, path: str) -> socket.socket:
        route = self._routes[path]
        source = (route.source, 0) if route.source is not None else None
        sock = socket.create_connection(route.destination, timeout=self._connect_timeout_s, source_address=source)
        wire.set_io_timeout(sock, self._io_timeout_s)
        wire.set_send_buffer(sock, self._send_buffer_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sockets[path] = sock
        if self._is_stopping.is_set():
            sock.shutdown(socket.SHUT_RDWR)
        try:
            client_handshake(sock, self._credentials, self.endpoint)
        except BaseException:
            self._close(path, sock)
            raise
        return sock

    def _close(self, path: str, sock: socket.socket | None) -> None:
        with self._lock:
            self._sockets.pop(path, None)
        if sock is not None:
            sock.close()


def _take_failed(in_flight: InFlight, piece: Piece | None) -> list[Piece]:
    """Every piece in flight on a failed connection, and the one being sent; empties `in_flight`."""
    failed = [p for _, p in in_flight]
    failed += [piece] if piece is not None and piece not in failed else []
    in_flight.clear()
    return failed


def _send_frame(sock: socket.socket, piece: Piece, tag: int) -> None:
    """Send one frame's header, and for WRITE its payload straight from the local segment."""
    op = wire.OP_WRITE if piece.op is TransferOp.WRITE else wire.OP_READ
    header = memoryview(wire.encode_request(op, piece.remote_name, tag, piece.remote_offset, piece.length))
    wire.send_all(sock, [header, piece.local_view] if op == wire.OP_WRITE else [header])


def _receive_reply(sock: socket.socket, piece: Piece, tag: int) -> None:
    """The reply to frame `tag`, and for READ its payload straight into the local segment."""
    status, message = wire.recv_reply(sock, tag)
    if status == wire.STATUS_BAD_REQUEST:
        raise wire.RemoteRejected(message)
    if status != wire.STATUS_OK:
        raise ConnectionError(f"server error: {message}")
    if piece.op is TransferOp.READ:
        wire.recv_exactly(sock, piece.local_view)
