"""The local end of a move between a store's pool and this process, and the byte ranges a move copies.

1. A caller registers a CPU buffer with a StoreClient (register_staging), which views it as bytes
   (staging_bytes) and returns a Staging: its segment name (moves with another host's store) and its bytes.
2. A tensor-parallel instance's rank pages are a LocalEnd instead (engine/tp_copy.py): no byte buffer, they copy
   spans themselves, and only with a store on this host.
3. Each move names its Spans: pool offset, offset in the local end, length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mooncaked.transfer import TransferOp


@dataclass(frozen=True)
class Staging:
    """A registered CPU buffer: `name` is its engine segment (when remote), `array` its bytes."""

    name: str
    array: np.ndarray  # [num_bytes] uint8 view of the caller's buffer


class LocalEnd(Protocol):
    """The local end of same-host moves that is no byte buffer (a tensor-parallel instance's rank pages:
    engine/tp_copy.py)."""

    def copy_spans(self, pool: np.ndarray, op: TransferOp, spans: Sequence[Span]) -> None: ...


@dataclass(frozen=True)
class Span:
    """Move `num_bytes` between pool offset `pool_offset` and staging offset `staging_offset`."""

    pool_offset: int
    staging_offset: int
    num_bytes: int


def staging_bytes(buffer: Any) -> np.ndarray:
    """`buffer` (bytearray, numpy array, contiguous CPU tensor) as a writable [num_bytes] uint8 array."""
    return np.frombuffer(_byte_view(buffer), dtype=np.uint8)


def _byte_view(buffer: Any) -> memoryview:
    if type(buffer).__module__.startswith("torch"):
        import torch  # a tensor was passed, so torch is already imported

        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("staging tensors must be contiguous CPU tensors")
        return memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError(f"staging buffer {type(buffer).__name__} is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
