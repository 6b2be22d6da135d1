"""The store's DRAM pool: one shared-memory file that same-host workers map read/write (zero-copy).

1. The store `create`s the file (e.g. /dev/shm/mooncaked-<cluster>-<instance>) at its configured size, replacing a
   stale one a crashed store left behind, and reserves the memory up front so a full /dev/shm fails here, not
   with SIGBUS on a later write. With `numa_node` the reserved pages come from that NUMA node.
2. Same-host workers `attach` by the path they derive themselves (`pool_path`, never a path a peer names); both
   sides see the same bytes. Offsets come from the store's allocator. `attach` refuses (PoolFileRefused) a
   symbolic link, anything but a regular file, a file of another user, and a size other than the expected one.
3. `close` drops the mapping; the creator also unlinks the file. Buffers handed out (`view`, `array`) must be
   released first (unregister the pool from the transfer engine before closing).
4. A restarted store creates a new file at the same path: `is_current()` tells an attached worker that its
   mapping is of the old, unlinked file, so it maps the new one (client.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import stat

import numpy as np

from mooncaked.runtime.numa import NumaError, memory_bound_to

logger = logging.getLogger(__name__)

_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


class PoolFileRefused(ValueError):
    """The file at a pool's path is not a pool this process may map (a link, not a regular file, another
    user's, or not the size the store reports)."""


def pool_path(cluster_id: str, instance: str, shm_dir: str = "/dev/shm") -> str:
    """The pool file's path for one store instance; unsafe characters in the names become '_'."""
    return os.path.join(shm_dir, f"mooncaked-{_SAFE_NAME.sub('_', cluster_id)}-{_SAFE_NAME.sub('_', instance)}")


class ShmPool:
    """One mapping of a pool file. Owner: the process that created or attached it (it alone closes it)."""

    def __init__(self, path: str, mapping: mmap.mmap, is_owner: bool, file_id: tuple[int, int] = (0, 0)) -> None:
        self.path = path
        self.file_id = file_id  # (st_dev, st_ino) of the mapped file
        self.num_bytes = len(mapping)
        self.is_owner = is_owner
        self._mapping = mapping
        self.view = memoryview(mapping)
        self.array: np.ndarray = np.frombuffer(self.view, dtype=np.uint8)  # [num_bytes]

    @classmethod
    def create(cls, path: str, num_bytes: int, is_populate: bool = True, numa_node: int | None = None) -> ShmPool:
        if num_bytes <= 0:
            raise ValueError(f"pool size must be positive, got {num_bytes}")
        if os.path.exists(path):
            logger.warning("replacing stale pool file %s", path)
            os.unlink(path)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        placement = memory_bound_to(numa_node) if numa_node is not None else contextlib.nullcontext()
        try:
            try:
                with placement:  # tmpfs allocates the file's pages here, under this thread's memory policy
                    os.posix_fallocate(fd, 0, num_bytes)
            except NumaError:
                os.unlink(path)
                raise
            except OSError as error:
                os.unlink(path)
                raise OSError(f"cannot reserve {num_bytes} bytes for pool {path}: {error}; "
                              "lower the store's dram_bytes or free space there") from error
            mapping = _map(fd, num_bytes, is_populate)
            file_id = _file_id(os.fstat(fd))
        finally:
            os.close(fd)
        return cls(path, mapping, is_owner=True, file_id=file_id)

    @classmethod
    def attach(cls, path: str, is_populate: bool = True, expected_bytes: int | None = None) -> ShmPool:
        """Map the pool file at `path` read-write; PoolFileRefused when it is not one (see the module docstring)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(f"no store pool at {path}: is the store on this host running?") from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise PoolFileRefused(f"{path} is a symbolic link, not a store pool: not mapped") from None
            raise
        try:
            status = os.fstat(fd)
            _check_pool_file(path, status, expected_bytes)
            mapping = _map(fd, status.st_size, is_populate)
        finally:
            os.close(fd)
        return cls(path, mapping, is_owner=False, file_id=_file_id(status))

    def is_current(self) -> bool:
        """Whether `path` still names the mapped file (False once the store that made it was replaced)."""
        try:
            return _file_id(os.stat(self.path)) == self.file_id
        except FileNotFoundError:
            return False

    def write(self, offset: int, data: memoryview | bytes | np.ndarray) -> None:
        """Copy `data` into the pool at `offset`."""
        source = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
        self._check_range(offset, source.nbytes)
        self.array[offset : offset + source.nbytes] = source.reshape(-1)

    def read_into(self, offset: int, destination: memoryview | bytearray | np.ndarray) -> None:
        """Fill `destination` from the pool at `offset`."""
        target = destination.view(np.uint8) if isinstance(destination, np.ndarray) else np.frombuffer(
            destination, dtype=np.uint8)
        self._check_range(offset, target.nbytes)
        target.reshape(-1)[:] = self.array[offset : offset + target.nbytes]

    def read(self, offset: int, num_bytes: int) -> bytes:
        self._check_range(offset, num_bytes)
        return self.view[offset : offset + num_bytes].tobytes()

    def close(self) -> None:
        del self.array
        try:
            self.view.release()
            self._mapping.close()
        except BufferError:
            # A worker thread that just finished a copy may hold a slice for a moment longer; the mapping is
            # unmapped when the last reference goes, and the file is unlinked below either way.
            logger.debug("pool %s still has exported buffers; the mapping is closed when they are freed", self.path)
        if self.is_owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _check_range(self, offset: int, num_bytes: int) -> None:
        if offset < 0 or offset + num_bytes > self.num_bytes:
            raise ValueError(f"range [{offset}, {offset + num_bytes}) is outside the pool of {self.num_bytes} bytes")


def attach_local(pool_path: str, *, reported_path: str, reported_bytes: int, is_required: bool) -> ShmPool | None:
    """A same-host worker's mapping of its store's pool: the file at `pool_path` (derived from the worker's own
    config) when the store reports that same path and the file passes `attach`'s checks; else None (moves go over
    the network), or, `is_required` (no network), the reason as PoolFileRefused."""
    if reported_path != pool_path:
        problem = (f"the store reports its pool at {reported_path!r}, but this worker's config puts it at "
                   f"{pool_path!r} (cluster.id, store.shm_dir): not mapped")
        if is_required:
            raise PoolFileRefused(problem)
        logger.warning("%s; moving bytes over the network", problem)
        return None
    if not os.path.lexists(pool_path):
        return None  # not visible here (another mount namespace, say): over the network
    try:
        # not prefaulted: the pool is the store's memory (it prefaults it); a worker maps the pages it touches
        # (a first touch costs a minor fault) instead of counting the whole pool in its own resident set
        return ShmPool.attach(pool_path, is_populate=False, expected_bytes=reported_bytes)
    except PoolFileRefused as refusal:
        if is_required:
            raise
        logger.error("%s; moving bytes over the network", refusal)
        return None


def _check_pool_file(path: str, status: os.stat_result, expected_bytes: int | None) -> None:
    if not stat.S_ISREG(status.st_mode):
        raise PoolFileRefused(f"{path} is not a regular file, so not a store pool: not mapped")
    if status.st_uid != os.geteuid():
        raise PoolFileRefused(f"{path} belongs to uid {status.st_uid}, not this process's {os.geteuid()}: a store "
                              "pool is made by a store running as the same user; not mapped")
    if expected_bytes is not None and status.st_size != expected_bytes:
        raise PoolFileRefused(f"{path} has {status.st_size} bytes, the store reports {expected_bytes}: not mapped")


def _file_id(status: os.stat_result) -> tuple[int, int]:
    return status.st_dev, status.st_ino


def _map(fd: int, num_bytes: int, is_populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED
    if is_populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)  # prefault: first-touch page faults would halve memcpy speed
    return mmap.mmap(fd, num_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
