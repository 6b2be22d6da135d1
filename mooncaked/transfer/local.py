"""Local transport: memcpy between segments mapped on this host.

1. `copy` queues one request's copy on a small thread pool.
2. A pool thread copies in chunks with numpy (the GIL is released during each chunk), reporting progress after
   each and stopping early once the batch has failed.
3. `stop` waits for running copies and shuts the pool down.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from mooncaked.transfer.batch import BatchRecord

_CHUNK_BYTES = 16 << 20


class LocalTransport:
    """Owns the copy thread pool."""

    def __init__(self, num_threads: int = 2) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="rdma-local")

    def copy(self, batch: BatchRecord, request_index: int, dst: memoryview, src: memoryview) -> None:
        self._pool.submit(_copy_chunks, batch, request_index, [dst, src])

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _copy_chunks(batch: BatchRecord, request_index: int, views: list[memoryview]) -> None:
    """Copy views[1] into views[0]. Every reference to the views is dropped before the last progress report,
    so a caller may unmap the memory as soon as its wait returns."""
    dst_array = np.frombuffer(views[0], dtype=np.uint8)
    src_array = np.frombuffer(views[1], dtype=np.uint8)
    views.clear()
    num_bytes = dst_array.nbytes
    try:
        for start in range(0, num_bytes, _CHUNK_BYTES):
            if batch.is_finished:
                return
            end = min(start + _CHUNK_BYTES, num_bytes)
            np.copyto(dst_array[start:end], src_array[start:end])
            if end < num_bytes:
                batch.add_done(end - start)
    except Exception as exc:  # report any copy failure on the batch rather than losing it in the pool
        batch.fail(f"request {request_index}: local copy failed: {type(exc).__name__}: {exc}")
        return
    finally:
        del dst_array, src_array
    batch.add_done(num_bytes - (num_bytes - 1) // _CHUNK_BYTES * _CHUNK_BYTES)
