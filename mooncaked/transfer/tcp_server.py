"""The engine's data listener: serves READ/WRITE frames against registered segments (TCP transport).

1. `start` binds the listening socket and starts the accept thread; it returns the bound port. With NICs it
   also listens on each NIC's address, on the same port (a port chosen by the kernel that is taken on some NIC
   address is given up and another chosen, up to _BIND_ATTEMPTS times), one accept thread per address.
2. Each accepted connection gets one thread with a blocking socket. It first runs the server side of the
   handshake (handshake.py: cluster id, and the cluster secret when one is configured) within
   `handshake_timeout_s`; a peer that fails it gets one error reply and is closed before any frame is read.
   One address may hold MAX_HANDSHAKES_PER_ADDRESS connections in their handshake at once; more are closed as
   they are accepted (one warning when an address reaches the cap), so silent connections cannot pile up threads.
3. Then, frame by frame: wait up to `idle_timeout_s` for the next frame (a connection idle longer is closed;
   clients reconnect before reusing one idle for half that, tcp_client.py), read its header, receive the payload
   straight into the segment (`recv_into`) or send straight from it (`sendall` of a memoryview). Within a frame
   every send and receive must move bytes within `io_timeout_s`: a peer that stalls mid-frame is cut off.
4. A frame outside a segment, or for an unknown segment, gets an error reply; the connection stays usable.
5. `stop` closes the listener, shuts every connection down, and joins the threads within a deadline.

Blocking sockets on threads rather than asyncio streams: the GIL is released in every send/recv, so copies
run in parallel, and a whole payload moves in one call (`MSG_WAITALL`, see wire.py) with no per-chunk Python
objects (measured: see `mooncaked bench transfer`). For a READ the reply header and the payload leave in one
`sendmsg`.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from mooncaked.transfer import wire
from mooncaked.transfer.handshake import DataCredentials, serve_handshake
from mooncaked.transfer.nics import Nic, encode_advert
from mooncaked.transfer.segments import SegmentTable

logger = logging.getLogger(__name__)

ControlHandler = Callable[[bytes], str]
_DRAIN_BYTES = 1 << 20
_ACCEPT_POLL_S = 0.25
_BIND_ATTEMPTS = 8
MAX_HANDSHAKES_PER_ADDRESS = 64


class DataServer:
    """Owns the listening socket, the accepted connections, their threads and the per-address handshake counts."""

    def __init__(
        self,
        host: str,
        port: int,
        segments: SegmentTable,
        control: ControlHandler | None = None,
        *,
        credentials: DataCredentials,
        handshake_timeout_s: float,
        io_timeout_s: float,
        idle_timeout_s: float,
        send_buffer_bytes: int = 0,
        nics: Sequence[Nic] = (),
    ) -> None:
        """`send_buffer_bytes`: SO_SNDBUF of each connection, which carries READ payloads (0: kernel default);
        `nics`: this host's NICs, listened on besides `host` and advertised to authenticated clients."""
        self._host = host
        self._nic_addresses = [nic.address for nic in nics if nic.address != host]
        self._advert = encode_advert(nics) if nics else b""
        self._credentials = credentials
        self._handshake_timeout_s = handshake_timeout_s
        self._io_timeout_s = io_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._send_buffer_bytes = send_buffer_bytes
        self._port = port
        self._segments = segments
        self._control = control
        self._listeners: list[socket.socket] = []
        self._connections: set[socket.socket] = set()
        self._num_handshaking: Counter[str] = Counter()  # by peer address
        self._capped: set[str] = set()  # addresses warned about at the handshake cap
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._is_stopping = threading.Event()

    def start(self) -> int:
        for attempt in range(_BIND_ATTEMPTS):
            try:
                self._listeners = _bind_all([self._host, *self._nic_addresses], self._port)
                break
            except OSError as exc:
                if self._port != 0 or exc.errno != errno.EADDRINUSE or attempt == _BIND_ATTEMPTS - 1:
                    raise
        for listener in self._listeners:
            listener.settimeout(_ACCEPT_POLL_S)
            self._spawn(self._accept_loop, f"rdma-accept-{listener.getsockname()[0]}", listener)
        return int(self._listeners[0].getsockname()[1])

    def stop(self, timeout_s: float) -> None:
        self._is_stopping.set()
        for listener in self._listeners:
            _shutdown(listener)  # wakes the accept loop at once
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            _shutdown(conn)
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(max(deadline - time.monotonic(), 0.0))
        for listener in self._listeners:
            listener.close()

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._is_stopping.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            if not self._admit(peer[0]):
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            wire.set_send_buffer(conn, self._send_buffer_bytes)
            with self._lock:
                self._connections.add(conn)
            self._spawn(self._serve_connection, f"rdma-serve-{peer[0]}:{peer[1]}", conn, peer[0], peer[1])

    def _serve_connection(self, conn: socket.socket, address: str, port: int) -> None:
        scratch = bytearray(wire.REQUEST.size + wire.MAX_NAME_BYTES)
        try:
            if not self._is_authenticated(conn, address, f"{address}:{port}"):
                return
            while not self._is_stopping.is_set():
                if not _is_readable_within(conn, self._idle_timeout_s):
                    logger.debug("data connection from %s:%d idle for %.0f s: closed", address, port,
                                 self._idle_timeout_s)
                    break
                header = wire.recv_request_header(conn, scratch)
                if header is None or not self._serve_frame(conn, header):
                    break
        except OSError as exc:
            logger.debug("data connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _admit(self, address: str) -> bool:
        with self._lock:
            if self._num_handshaking[address] < MAX_HANDSHAKES_PER_ADDRESS:
                self._num_handshaking[address] += 1
                self._capped.discard(address)
                return True
            is_newly_capped = address not in self._capped
            self._capped.add(address)
        if is_newly_capped:
            logger.warning("data port: %s holds %d connections that have not completed the handshake; closing "
                           "its further connections until they do or time out", address, MAX_HANDSHAKES_PER_ADDRESS)
        return False

    def _is_authenticated(self, conn: socket.socket, address: str, peer: str) -> bool:
        try:
            wire.set_io_timeout(conn, self._handshake_timeout_s)
            refusal = serve_handshake(conn, self._credentials, self._advert)
        except OSError as exc:
            logger.warning("data connection from %s closed during the handshake: %s", peer, exc)
            return False
        finally:
            self._end_handshake(address)
        if refusal:
            logger.warning("data connection from %s refused: %s", peer, refusal)
            return False
        wire.set_io_timeout(conn, self._io_timeout_s)
        return True

    def _end_handshake(self, address: str) -> None:
        with self._lock:
            self._num_handshaking[address] -= 1
            if self._num_handshaking[address] <= 0:
                del self._num_handshaking[address]

    def _serve_frame(self, conn: socket.socket, header: wire.RequestHeader) -> bool:
        """Serve one frame; False when the connection must close."""
        if header.op == wire.OP_CONTROL:
            return self._serve_control(conn, header)
        if header.op not in (wire.OP_READ, wire.OP_WRITE):
            wire.send_reply(conn, header.tag, wire.STATUS_BAD_REQUEST, f"unknown op {header.op}")
            return False
        try:
            view = self._segments.view(header.name, header.offset, header.length)
        except ValueError as exc:
            if header.op == wire.OP_WRITE:
                wire.drain(conn, header.length, bytearray(_DRAIN_BYTES))
            wire.send_reply(conn, header.tag, wire.STATUS_BAD_REQUEST, str(exc))
            return True
        if header.op == wire.OP_WRITE:
            wire.recv_exactly(conn, view)
            del view  # the segment may be unmapped once the writer sees the reply
            wire.send_reply(conn, header.tag, wire.STATUS_OK)
        else:
            wire.send_all(conn, [memoryview(wire.REPLY.pack(header.tag, wire.STATUS_OK, 0)), view])
        return True

    def _serve_control(self, conn: socket.socket, header: wire.RequestHeader) -> bool:
        if header.length > wire.MAX_MESSAGE_BYTES:
            wire.send_reply(conn, header.tag, wire.STATUS_BAD_REQUEST, "control message too large")
            return False
        payload = bytearray(header.length)
        wire.recv_exactly(conn, memoryview(payload))
        if self._control is None:
            wire.send_reply(conn, header.tag, wire.STATUS_BAD_REQUEST, "this engine serves no control messages")
            return True
        try:
            answer = self._control(bytes(payload))
        except ValueError as exc:
            wire.send_reply(conn, header.tag, wire.STATUS_BAD_REQUEST, str(exc))
            return True
        except Exception as exc:  # a control handler bug must not kill the data connection silently
            logger.exception("control handler failed")
            wire.send_reply(conn, header.tag, wire.STATUS_INTERNAL, f"{type(exc).__name__}: {exc}")
            return True
        wire.send_reply(conn, header.tag, wire.STATUS_OK, answer)
        return True


def _bind_all(addresses: list[str], port: int) -> list[socket.socket]:
    """Listeners on every address, all on one port (the first's when `port` is 0); all or none."""
    listeners: list[socket.socket] = []
    try:
        for address in addresses:
            listeners.append(socket.create_server((address, port), backlog=128, reuse_port=False))
            port = int(listeners[0].getsockname()[1])
    except OSError:
        for listener in listeners:
            listener.close()
        raise
    return listeners


def _is_readable_within(conn: socket.socket, timeout_s: float) -> bool:
    """Whether `conn` has bytes (or its end: a close, a shutdown) to read within `timeout_s`."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
