"""The baselines of `mooncaked bench transfer` (transfer.py): the shape of a pass, and raw sockets, gloo and
memcpy moving its bytes. Each receiver or rank runs in a spawned process of its own.

1. `Plan` says how many bytes move as how many requests, how many in flight, over how many connections.
2. Raw sockets: `raw_receiver` (child) accepts the connections and lands each request in its ring slot;
   `raw_pass` sends one pass over them from threads, and waits for the receiver's acknowledgement.
3. gloo: `gloo_rank` (child, both ranks) runs a pass of isend/irecv per command; `gloo_pass` times one.
4. `memcpy_pass`: the same bytes copied within this process.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

HEADER = struct.Struct("<QQ")  # slot offset, length; length 0 ends a pass, END ends the stream
END = 1 << 63
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Plan:
    total_bytes: int
    request_bytes: int
    in_flight: int
    connections: int
    repeats: int

    @property
    def num_requests(self) -> int:
        return self.total_bytes // self.request_bytes


def make_ring(plan: Plan) -> np.ndarray:
    ring = np.empty(plan.in_flight * plan.request_bytes, np.uint8)
    ring.fill(1)  # fault the pages in before anything is timed
    return ring



# raw sockets -----------------------------------------------------------------------------------------------------


def raw_receiver(conn: Connection, plan: Plan) -> None:
    ring = memoryview(make_ring(plan).data)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        sockets = [listener.accept()[0] for _ in range(plan.connections)]
    threads = [threading.Thread(target=_raw_receive_stream, args=(sock, ring)) for sock in sockets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _raw_receive_stream(sock: socket.socket, ring: memoryview) -> None:
    header = bytearray(HEADER.size)
    with sock:
        while True:
            _recv_exactly(sock, memoryview(header))
            slot_offset, length = HEADER.unpack(header)
            if length == END:
                return
            if length == 0:
                sock.sendall(b"k")  # this pass's bytes have all arrived
                continue
            _recv_exactly(sock, ring[slot_offset : slot_offset + length])


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        num_received = sock.recv_into(view)
        if num_received == 0:
            raise ConnectionError("sender closed early")
        view = view[num_received:]


def raw_pass(plan: Plan, sockets: list[socket.socket], ring: memoryview) -> float:
    started = time.perf_counter()
    threads = [
        threading.Thread(target=_raw_send_stream, args=(sock, ring, plan, index)) for index, sock in enumerate(sockets)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def _raw_send_stream(sock: socket.socket, ring: memoryview, plan: Plan, index: int) -> None:
    for request in range(index, plan.num_requests, plan.connections):
        offset = (request % plan.in_flight) * plan.request_bytes
        sock.sendall(HEADER.pack(offset, plan.request_bytes))
        sock.sendall(ring[offset : offset + plan.request_bytes])
    sock.sendall(HEADER.pack(0, 0))
    if sock.recv(1) != b"k":
        raise ConnectionError("raw receiver did not acknowledge")


# gloo ------------------------------------------------------------------------------------------------------------


def gloo_rank(rank: int, port: int, plan: Plan, conn: Connection) -> None:
    """One gloo rank: a pass per "pass" command on `conn`, answering with its seconds; "stop" ends it."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ring = torch.from_numpy(make_ring(plan))
    slots = [ring[i * plan.request_bytes : (i + 1) * plan.request_bytes] for i in range(plan.in_flight)]
    conn.send("ready")
    while conn.recv() == "pass":
        dist.barrier()
        started = time.perf_counter()
        pending: collections.deque[Any] = collections.deque()
        for index in range(plan.num_requests):
            if len(pending) == plan.in_flight:
                pending.popleft().wait()
            slot = slots[index % plan.in_flight]
            pending.append(dist.isend(slot, 1, tag=index) if rank == 0 else dist.irecv(slot, 0, tag=index))
        for work in pending:
            work.wait()
        conn.send(time.perf_counter() - started)
    dist.destroy_process_group()


def gloo_pass(pipes: list[Connection]) -> float:
    """Seconds of one gloo pass on the receiver's clock (a pass ends when the last bytes have landed)."""
    for pipe in pipes:
        pipe.send("pass")
    seconds = []
    for pipe in pipes:
        if not pipe.poll(TIMEOUT_S):
            raise RuntimeError("a gloo rank did not finish its pass")
        seconds.append(float(pipe.recv()))
    return seconds[1]


# memcpy ----------------------------------------------------------------------------------------------------------


def memcpy_pass(plan: Plan, source: np.ndarray, ring: np.ndarray) -> float:
    started = time.perf_counter()
    for index in range(plan.num_requests):
        offset = (index % plan.in_flight) * plan.request_bytes
        end = offset + plan.request_bytes
        np.copyto(ring[offset:end], source[offset:end])
    return time.perf_counter() - started
