"""One client process of `mooncaked bench store` (store.py spawns them, one ClientSpec each).

1. client_main runs the spec's path: `store` or `shm` (a StoreClient over RPC, moving bytes through the TCP
   transfer engine from 127.0.0.2 or through the mapped pool) or `redis` (redis-py, pipelined).
2. Put: after the barrier, every object of this client's share gets a tag (index, client, run) in its first
   bytes and is written in batches (`depth` batches in flight for the store paths).
3. Get: after the barrier again, every object is read back and its tag checked; a missing or wrong one counts
   in `num_bad`.
4. The report (each phase's start and end, num_bad; or the error) goes to the parent through the pipe.
"""

from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np

LEASE_MS = 60_000
PHASE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ClientSpec:
    """One client process's part of a run: its path, index and share of the objects."""

    path: str
    client_index: int
    run_id: int
    num_objects: int
    object_bytes: int
    batch_objects: int
    depth: int
    store_address: str
    redis_port: int
    pool_path: str = ""  # the store's pool file, for same-host clients to map


def with_index(spec: ClientSpec, index: int) -> ClientSpec:
    return ClientSpec(**{**asdict(spec), "client_index": index})


def client_main(spec: ClientSpec, barrier: Barrier, writer: Connection) -> None:
    try:
        if spec.path == "redis":
            report = _redis_client(spec, barrier)
        else:
            report = asyncio.run(_store_client(spec, barrier))
    except Exception as error:  # reported to the parent, which fails the run
        barrier.abort()
        report = {"error": f"{type(error).__name__}: {error}"}
    writer.send(report)
    writer.close()


def _object_key(spec: ClientSpec, index: int) -> bytes:
    return struct.pack("<IIQ", spec.run_id, spec.client_index, index)


def _tag(spec: ClientSpec, index: int) -> bytes:
    return struct.pack("<IHH", index, spec.client_index, spec.run_id & 0xFFFF)


def _batches(spec: ClientSpec) -> list[list[int]]:
    step = spec.batch_objects
    return [list(range(s, min(s + step, spec.num_objects))) for s in range(0, spec.num_objects, step)]


async def _store_client(spec: ClientSpec, barrier: Barrier) -> dict[str, Any]:
    from mooncaked.store.client import StoreClient
    from mooncaked.transfer import TransferEngine
    from mooncaked.rpc import RpcClient

    rpc = RpcClient(spec.store_address, role="bench", instance=f"c{spec.client_index}", cluster_id="bench",
                    secret=None, pool_size=spec.depth, max_frame_bytes=64 << 20)
    is_network = spec.path == "store"
    engine = TransferEngine(host="127.0.0.2", transports=("tcp",)) if is_network else None
    if engine is not None:
        await engine.start()
    client = await StoreClient.connect(rpc, host="127.0.0.2" if is_network else "127.0.0.1", engine=engine,
                                       pool_path=spec.pool_path or None, is_shm_allowed=not is_network,
                                       timeout_s=PHASE_TIMEOUT_S)
    region_bytes = spec.batch_objects * spec.object_bytes
    staging = client.register_staging("bench-staging", np.random.default_rng(spec.client_index).integers(
        0, 256, size=spec.depth * region_bytes, dtype=np.uint8))  # [depth, batch_objects, object_bytes]
    num_bad = 0

    async def put_batches(region: int, queue: list[list[int]]) -> None:
        base = region * region_bytes
        while queue:
            batch = queue.pop()
            for i, index in enumerate(batch):
                start = base + i * spec.object_bytes
                staging.array[start : start + 8] = np.frombuffer(_tag(spec, index), dtype=np.uint8)
            reply = await client.allocate([_object_key(spec, i) for i in batch], spec.object_bytes, LEASE_MS)
            await client.write_blocks(staging, reply.handles, base)
            await client.commit([h.handle_id for h in reply.handles])

    async def get_batches(region: int, queue: list[list[int]]) -> None:
        nonlocal num_bad
        base = region * region_bytes
        while queue:
            batch = queue.pop()
            found = await client.lookup([_object_key(spec, i) for i in batch], LEASE_MS)
            await client.read_blocks(staging, found.locations, base)
            await client.release([found.read_lease_id])
            num_bad += len(batch) - len(found.locations)
            for i, index in enumerate(batch[: len(found.locations)]):
                start = base + i * spec.object_bytes
                num_bad += staging.array[start : start + 8].tobytes() != _tag(spec, index)

    report: dict[str, Any] = {}
    for phase, work in (("put", put_batches), ("get", get_batches)):
        queue = _batches(spec)[::-1]
        await asyncio.to_thread(barrier.wait, PHASE_TIMEOUT_S)
        started = time.monotonic()
        await asyncio.gather(*(work(region, queue) for region in range(spec.depth)))
        report[phase] = (started, time.monotonic())
    report["num_bad"] = int(num_bad)
    await client.close()
    await rpc.close()
    if engine is not None:
        await engine.stop()
    return report


def _redis_client(spec: ClientSpec, barrier: Barrier) -> dict[str, Any]:
    import redis

    connection = redis.Redis(host="127.0.0.1", port=spec.redis_port)
    values = [bytearray(np.random.default_rng(i).integers(0, 256, spec.object_bytes, dtype=np.uint8).tobytes())
              for i in range(spec.batch_objects)]  # one reusable buffer per object of a pipeline
    report: dict[str, Any] = {}
    num_bad = 0
    barrier.wait(PHASE_TIMEOUT_S)
    started = time.monotonic()
    for batch in _batches(spec):
        pipe = connection.pipeline(transaction=False)
        for value, index in zip(values, batch):
            value[:8] = _tag(spec, index)
            pipe.set(_object_key(spec, index), memoryview(value))
        pipe.execute()
    report["put"] = (started, time.monotonic())
    barrier.wait(PHASE_TIMEOUT_S)
    started = time.monotonic()
    for batch in _batches(spec):
        pipe = connection.pipeline(transaction=False)
        for index in batch:
            pipe.get(_object_key(spec, index))
        for index, data in zip(batch, pipe.execute()):
            num_bad += data is None or data[:8] != _tag(spec, index)
    report["get"] = (started, time.monotonic())
    report["num_bad"] = int(num_bad)
    connection.close()
    return report
