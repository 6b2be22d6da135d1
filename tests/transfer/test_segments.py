"""Segment registration: every supported buffer kind, views, and clear errors."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from mooncaked.transfer.segments import SegmentTable, as_byte_view


def test_buffer_kinds_give_flat_writable_views_without_copies() -> None:
    array = np.zeros((4, 8), np.float16)
    tensor = torch.zeros(3, 5, dtype=torch.bfloat16)
    with mmap.mmap(-1, 4096) as region:
        for buffer, num_bytes in ((bytearray(7), 7), (array, 64), (tensor, 30), (region, 4096)):
            view = as_byte_view(buffer)
            assert view.nbytes == num_bytes and view.format == "B" and not view.readonly
            view[0] = 1
        del view
    assert array.view(np.uint8)[0, 0] == 1
    assert tensor.view(torch.uint8)[0, 0] == 1


def test_rejected_buffers_say_why() -> None:
    with pytest.raises(ValueError, match="read-only bytes"):
        as_byte_view(b"abc")
    with pytest.raises(ValueError, match="non-contiguous ndarray"):
        as_byte_view(np.zeros((4, 4))[:, 1])
    with pytest.raises(ValueError, match="non-contiguous tensor"):
        as_byte_view(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="does not expose a buffer"):
        as_byte_view(object())


def test_table_views_are_bounds_checked() -> None:
    table = SegmentTable()
    table.register("a", bytearray(b"0123456789"), "cpu:1")
    assert bytes(table.view("a", 2, 3)) == b"234"
    with pytest.raises(ValueError, match=r"range \[8, 12\) is outside segment 'a' of 10 bytes"):
        table.view("a", 8, 4)
    with pytest.raises(ValueError, match="location must be 'cpu:N' or 'cuda:N'"):
        table.register("b", bytearray(1), "gpu0")
    table.unregister("a")
    with pytest.raises(ValueError, match="segment 'a' is not registered"):
        table.view("a", 0, 1)
    with pytest.raises(KeyError, match="not registered"):
        table.unregister("a")
