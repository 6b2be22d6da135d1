"""Registered memory segments of one engine, addressed by name.

1. `register` turns a buffer (memoryview, bytearray, mmap, numpy array, CPU torch tensor) into a flat,
   writable byte view and keeps a reference to the original object so the memory stays alive.
   `register_device` records GPU memory by address (`cuda:N`): its view only carries the address range to the
   RDMA transport (GPUDirect); no host code reads or writes through it.
2. `view` hands out a bounds-checked sub-view for a transfer; errors name the segment and the range. A device
   segment's view is handed out only to callers that move it by RDMA (`allow_device`).
3. `unregister` drops the name; views already handed out stay valid until their transfers end.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

DEFAULT_LOCATION = "cpu:0"


@dataclass(frozen=True)
class Segment:
    name: str
    view: memoryview  # flat uint8, writable
    location: str  # "cpu:N" | "cuda:N"
    owner: Any  # the registered object; holding it keeps `view`'s memory alive
    is_device: bool = False  # GPU memory: only RDMA (GPUDirect) may move it

    @property
    def num_bytes(self) -> int:
        return self.view.nbytes


def as_byte_view(buffer: Any) -> memoryview:
    """A flat writable uint8 view of `buffer` without copying."""
    if _is_torch_tensor(buffer):
        return _tensor_byte_view(buffer)
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise ValueError(f"cannot register a {type(buffer).__name__}: it does not expose a buffer") from exc
    if view.readonly:
        raise ValueError(f"cannot register a read-only {type(buffer).__name__}: transfers write into segments")
    if not view.c_contiguous:
        raise ValueError(f"cannot register a non-contiguous {type(buffer).__name__}")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _is_torch_tensor(buffer: Any) -> bool:
    return type(buffer).__module__.startswith("torch") and hasattr(buffer, "data_ptr")


def _tensor_byte_view(tensor: Any) -> memoryview:
    import torch  # a tensor was passed, so torch is already imported

    if tensor.device.type != "cpu":
        raise ValueError(f"cannot register a {tensor.device} tensor: only CPU memory is supported by tcp/local")
    if not tensor.is_contiguous():
        raise ValueError("cannot register a non-contiguous tensor; call .contiguous() first")
    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


class SegmentTable:
    """Owns the name -> Segment map of one engine; thread-safe (server threads read it)."""

    def __init__(self) -> None:
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def register(self, name: str, buffer: Any, location: str = DEFAULT_LOCATION) -> Segment:
        return self._add(Segment(name=name, view=as_byte_view(buffer), location=location, owner=buffer))

    def _add(self, segment: Segment) -> Segment:
        name = segment.name
        if not name or len(name.encode()) > 1024:
            raise ValueError(f"segment name must be 1..1024 UTF-8 bytes, got {name!r}")
        _check_location(segment.location)
        with self._lock:
            if name in self._segments:
                raise ValueError(f"segment {name!r} is already registered; unregister it first")
            self._segments[name] = segment
        return segment

    def register_device(self, name: str, address: int, num_bytes: int, location: str, owner: Any) -> Segment:
        """GPU memory [address, address + num_bytes) at `location` ("cuda:N"); `owner` keeps it allocated."""
        if not location.startswith("cuda:"):
            raise ValueError(f"device memory must be located at 'cuda:N', got {location!r}")
        if address <= 0 or num_bytes <= 0:
            raise ValueError(f"device memory needs a positive address and size, got {address:#x} +{num_bytes}")
        view = memoryview((ctypes.c_char * num_bytes).from_address(address)).cast("B")  # never dereferenced here
        return self._add(Segment(name=name, view=view, location=location, owner=owner, is_device=True))

    def unregister(self, name: str) -> None:
        with self._lock:
            if self._segments.pop(name, None) is None:
                raise KeyError(f"segment {name!r} is not registered")

    def get(self, name: str) -> Segment | None:
        with self._lock:
            return self._segments.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._segments)

    def view(self, name: str, offset: int, length: int, allow_device: bool = False) -> memoryview:
        """`length` bytes of segment `name` at `offset`; ValueError naming what is out of range, or a device
        segment asked for by a caller that would touch its bytes from the host."""
        segment = self.get(name)
        if segment is None:
            raise ValueError(f"segment {name!r} is not registered")
        if segment.is_device and not allow_device:
            raise ValueError(f"segment {name!r} is GPU memory ({segment.location}): only RDMA moves it")
        check_range(segment, offset, length)
        return segment.view[offset : offset + length]


def check_range(segment: Segment, offset: int, length: int) -> None:
    if offset < 0 or length < 0 or offset + length > segment.num_bytes:
        raise ValueError(
            f"range [{offset}, {offset + length}) is outside segment {segment.name!r} of {segment.num_bytes} bytes"
        )


def _check_location(location: str) -> None:
    kind, sep, index = location.partition(":")
    if kind not in ("cpu", "cuda") or not sep or not index.isdigit():
        raise ValueError(f"location must be 'cpu:N' or 'cuda:N', got {location!r}")
