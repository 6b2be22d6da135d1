"""The command channel between a tensor-parallel instance's rank 0 and one other rank: one end of a socketpair.

1. Rank 0 creates `RankChannel.pair(timeout_s)`, keeps one end and hands the other's socket to the spawned rank.
2. Messages are small tuples (a command name and a batch of a few tensors), pickled and length-prefixed.
   Sending and the rest of a message once its first byte arrived wait at most `timeout_s` (a rank that stops
   reading makes the sender fail, never block); `wait_readable(deadline, sentinel)` waits for the next message
   until a deadline or until a process exits (a rank idles there, watching its parent).
3. Either end closes its socket when done; the other then reads EOF (ChannelClosed).
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")


class ChannelClosed(ConnectionError):
    """The other end closed its socket (its process exited) or did not answer in time."""


class RankChannel:
    """Owns one end of a socketpair (the rank 0 side or a rank's side)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        sock.settimeout(timeout_s)
        self.sock = sock
        self.timeout_s = timeout_s

    @classmethod
    def pair(cls, timeout_s: float) -> tuple[RankChannel, socket.socket]:
        """(rank 0's channel, the socket to give the other rank)."""
        ours, theirs = socket.socketpair()
        return cls(ours, timeout_s), theirs

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.sock.sendall(_HEADER.pack(len(data)) + data)
        except OSError as exc:  # socket.timeout included: the other end stopped reading
            raise ChannelClosed(f"cannot send to the other rank: {exc}") from exc

    def recv(self) -> tuple[Any, ...]:
        (size,) = _HEADER.unpack(self._read(_HEADER.size))
        message: tuple[Any, ...] = pickle.loads(self._read(size))
        return message

    def wait_readable(self, timeout_s: float | None, sentinel: int | None = None) -> bool:
        """True when a message (or EOF) is ready; False when `sentinel` (a process's) became ready first or
        `timeout_s` passed (None: no deadline besides the sentinel)."""
        watched: list[Any] = [self.sock] if sentinel is None else [self.sock, sentinel]
        ready, _, _ = select.select(watched, [], [], timeout_s)
        return self.sock in ready

    def send_fds(self, fds: list[int]) -> None:
        """Pass file descriptors (before any message: the shared all-reduce segment's, engine.tp.shm)."""
        try:
            socket.send_fds(self.sock, [b"f"], fds)
        except OSError as exc:
            raise ChannelClosed(f"cannot send to the other rank: {exc}") from exc

    def recv_fds(self, num_fds: int) -> list[int]:
        try:
            _, fds, _, _ = socket.recv_fds(self.sock, 1, num_fds)
        except OSError as exc:
            raise ChannelClosed(f"cannot read from the other rank: {exc}") from exc
        if len(fds) != num_fds:
            raise ChannelClosed(f"the other rank sent {len(fds)} file descriptors, not {num_fds}")
        return fds

    def close(self) -> None:
        self.sock.close()

    def _read(self, size: int) -> bytes:
        chunks: list[bytes] = []
        remaining = size
        while remaining:
            try:
                chunk = self.sock.recv(min(remaining, 1 << 20))
            except OSError as exc:
                raise ChannelClosed(f"cannot read from the other rank: {exc}") from exc
            if not chunk:
                raise ChannelClosed("the other rank closed its channel")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
