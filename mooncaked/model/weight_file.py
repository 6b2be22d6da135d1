"""A model's weights as one file per host, mapped read-only by every process that serves the model.

1. `WeightLayout.of(named tensors)`: what a model holds (name, shape) in one dtype, split into two sections:
   `projections` (the Linear weights, which a decode process replaces with MKL-packed copies) and `resident`
   (embedding, norms, biases). Each section starts on a page boundary, so a process keeps one mapped and lets
   the other go.
2. `open_weight_file(path, key, layout, fill)` maps the file at `path` when its header names `key` (the
   source's identity, dtype and layout) and `layout`. Else it builds one, holding a lock next to it (flock on
   `.<name>.lock`) so that the host's other processes wait for it instead of converting too, up to
   `lock_wait_s`: a nameless file (O_TMPFILE) in the same directory, its space reserved up front (a full disk
   fails here, not with SIGBUS on a later write), mapped writable and filled by `fill(views)` (the loader
   streams the checkpoint into the views), flushed to disk, then linked under `path`. A process that waited
   maps the file the lock holder linked; one that waited past `lock_wait_s` builds too, and then the first link
   wins and the other maps the winner's file: either way all end up on the same page-cache pages.
3. It returns read-only views (PROT_READ, MAP_SHARED), one per tensor. A view keeps its section's mapping
   alive; the mapping is unmapped when its section's last view is dropped.

File: MAGIC, u64 header length, the JSON header, then the sections, each page-aligned; tensors 64-byte aligned.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

MAGIC = b"MCDWGHT1"
SECTIONS = ("resident", "projections")
_TENSOR_ALIGN = 64
_PAGE = mmap.ALLOCATIONGRANULARITY
_PREFIX = struct.Struct("<8sQ")  # magic, header length
LOCK_WAIT_S = 600.0  # longest wait for another process's conversion (a large checkpoint takes minutes)
_LOCK_POLL_S = 0.1


class WeightFileError(OSError):
    """The weight file could not be built or mapped; the loader then keeps the weights in private memory."""


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    section: str
    offset: int  # from the start of its section

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class WeightLayout:
    """Where each tensor lives in the file; immutable."""

    dtype: torch.dtype
    slots: tuple[TensorSlot, ...]
    section_nbytes: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, tuple[int, ...], str]], dtype: torch.dtype) -> WeightLayout:
        """`tensors`: (name, shape, section) in file order."""
        ends = dict.fromkeys(SECTIONS, 0)
        slots = []
        for name, shape, section in tensors:
            slot = TensorSlot(name, tuple(shape), section, ends[section])
            slots.append(slot)
            ends[section] = _round_up(slot.offset + slot.numel * dtype.itemsize, _TENSOR_ALIGN)
        return cls(dtype, tuple(slots), tuple(ends.items()))

    def describe(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."),
                "tensors": [[s.name, list(s.shape), s.section, s.offset] for s in self.slots],
                "sections": [list(item) for item in self.section_nbytes]}

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.section_nbytes)


def cache_key(source_files: Iterable[Path], layout: WeightLayout, shard_tag: str = "") -> str:
    """Hex digest naming a source (each file's resolved path, size and mtime) converted to `layout` (for the
    tensor-parallel shard `shard_tag` names, if any: ranks' layouts can be alike, their contents are not)."""
    files = []
    for path in source_files:
        stat = path.stat()
        files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    described: dict[str, Any] = {"files": files, "layout": layout.describe()}
    if shard_tag:
        described["shard"] = shard_tag
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def open_weight_file(path: Path, key: str, layout: WeightLayout, fill: Callable[[dict[str, torch.Tensor]], None],
                     lock_wait_s: float = LOCK_WAIT_S) -> dict[str, torch.Tensor]:
    """Read-only views of every tensor of `layout` in the file at `path` (built with `fill` if needed)."""
    views = _map_if_valid(path, key, layout)
    if views is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(path, lock_wait_s):
            views = _map_if_valid(path, key, layout)  # built by the process we waited for
            if views is None:
                _build_unlocked(path, key, layout, fill)
                views = _map_if_valid(path, key, layout)
    if views is None:
        raise WeightFileError(f"{path} was written but does not read back; delete it and restart")
    logger.info("mapped weights from %s (%.2f GiB, shared with this host's other processes)", path,
                layout.nbytes / (1 << 30))
    return views


@contextlib.contextmanager
def _build_lock(path: Path, wait_s: float) -> Iterator[None]:
    """Hold `.<name>.lock` beside `path` (released when the process dies, too); past `wait_s`, go on without."""
    fd = os.open(path.parent / f".{path.name}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while not _try_lock(fd):
            if time.monotonic() >= deadline:
                logger.warning("%s: another process has been converting it for %.0f s; converting here too",
                               path, wait_s)
                break
            time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _build_unlocked(path: Path, key: str, layout: WeightLayout,
                    fill: Callable[[dict[str, torch.Tensor]], None]) -> None:
    if path.exists():
        logger.warning("weight file %s does not match this model (stale or damaged); rebuilding it", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # processes that mapped it keep their mapping
    _build(path, key, layout, fill)


def _header(key: str, layout: WeightLayout) -> tuple[bytes, dict[str, int]]:
    """(encoded prefix + header, section -> absolute offset)."""
    body = json.dumps({"key": key, **layout.describe()}, sort_keys=True).encode()
    start = _round_up(_PREFIX.size + len(body), _PAGE)
    offsets = {}
    for section, nbytes in layout.section_nbytes:
        offsets[section] = start
        start = _round_up(start + nbytes, _PAGE)
    return _PREFIX.pack(MAGIC, len(body)) + body, offsets


def _map_if_valid(path: Path, key: str, layout: WeightLayout) -> dict[str, torch.Tensor] | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        header, offsets = _header(key, layout)
        size = os.fstat(fd).st_size
        end = max(offsets[s] + n for s, n in layout.section_nbytes)
        if os.pread(fd, len(header), 0) != header or size < end:
            return None
        return _views(fd, layout, offsets, is_writable=False)
    finally:
        os.close(fd)


def _views(fd: int, layout: WeightLayout, offsets: Mapping[str, int], is_writable: bool) -> dict[str, torch.Tensor]:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if is_writable else 0)
    storages = {}
    for section, nbytes in layout.section_nbytes:
        if nbytes == 0:
            continue
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot, offset=offsets[section])
        with warnings.catch_warnings():  # "non-writable buffer": read-only is the point; a write faults
            warnings.simplefilter("ignore", UserWarning)
            storages[section] = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    itemsize = layout.dtype.itemsize
    return {slot.name: storages[slot.section][slot.offset: slot.offset + slot.numel * itemsize]
            .view(layout.dtype).view(slot.shape) for slot in layout.slots}


def _build(path: Path, key: str, layout: WeightLayout, fill: Callable[[dict[str, torch.Tensor]], None]) -> None:
    header, offsets = _header(key, layout)
    total = max([offsets[s] + n for s, n in layout.section_nbytes] + [len(header)])
    fd, temp_name = _nameless_file(path.parent)
    try:
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            raise WeightFileError(f"cannot reserve {total / (1 << 30):.2f} GiB for {path}: {exc}") from exc
        os.pwrite(fd, header, 0)
        views = _views(fd, layout, offsets, is_writable=True)
        fill(views)
        del views  # the writable mappings go with their last view
        os.fsync(fd)  # a file linked before its data is on disk could serve garbage after a power loss
        _link(fd, temp_name, path)
    finally:
        os.close(fd)
        if temp_name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)


def _nameless_file(directory: Path) -> tuple[int, str | None]:
    """(fd, None) for an O_TMPFILE file, or (fd, name) of a named temporary where the filesystem has none."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o644), None
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise WeightFileError(f"cannot create a weight file in {directory}: {exc}") from exc
    fd, name = tempfile.mkstemp(dir=directory, prefix=".weights-")
    os.fchmod(fd, 0o644)
    return fd, name


def _link(fd: int, temp_name: str | None, path: Path) -> None:
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if temp_name is not None:
            os.link(temp_name, path)
        else:  # a dir_fd makes os.link call linkat with AT_SYMLINK_FOLLOW, which links the fd's nameless file
            os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=directory)
    except FileExistsError:
        logger.info("another process wrote %s first; mapping its file", path)
        return
    finally:
        os.close(directory)
    logger.info("wrote weight file %s", path)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
