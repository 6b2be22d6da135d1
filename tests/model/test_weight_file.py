"""The per-host weight file: built once, mapped read-only, rebuilt when stale, one winner when builders race."""

from __future__ import annotations

import concurrent.futures
import fcntl
import gc
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.model.weight_file import SECTIONS, WeightLayout, cache_key, open_weight_file

SHAPES = [("embed", (7, 5), "resident"), ("norm", (5,), "resident"), ("qkv", (5, 9), "projections"),
          ("down", (3, 5), "projections")]


def _values(layout: WeightLayout, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=generator).to(layout.dtype) for s in layout.slots}


def _filler(values: dict[str, torch.Tensor], calls: list[str]) -> Callable[[dict[str, torch.Tensor]], None]:
    def fill(views: dict[str, torch.Tensor]) -> None:
        calls.append("fill")
        for name, view in views.items():
            view.copy_(values[name])
    return fill


def _mappings(path: Path) -> list[str]:
    """This process's mappings of `path` (the /proc/self/maps lines)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if line.rstrip().endswith(str(path))]


def test_built_once_then_mapped_read_only_and_shared(tmp_path: Path) -> None:
    layout = WeightLayout.of(SHAPES, torch.float32)
    path, values, calls = tmp_path / "m.weights", _values(layout, 0), list[str]()
    first = open_weight_file(path, "k1", layout, _filler(values, calls))
    second = open_weight_file(path, "k1", layout, _filler(values, calls))
    assert calls == ["fill"]  # the second open maps the file the first one wrote
    for name, expected in values.items():
        torch.testing.assert_close(first[name], expected, rtol=0, atol=0)
        torch.testing.assert_close(second[name], expected, rtol=0, atol=0)
    lines = _mappings(path)
    assert lines and all(line.split()[1] == "r--s" for line in lines)  # read-only, shared with the page cache
    assert sorted(os.listdir(tmp_path)) == [".m.weights.lock", "m.weights"]  # nothing else left behind


def test_each_section_is_unmapped_with_its_last_view(tmp_path: Path) -> None:
    layout = WeightLayout.of(SHAPES, torch.float32)
    path = tmp_path / "m.weights"
    views = open_weight_file(path, "k", layout, _filler(_values(layout, 1), []))
    num_before = len(_mappings(path))
    for slot in layout.slots:
        if slot.section == "projections":
            del views[slot.name]
    gc.collect()
    assert len(_mappings(path)) == num_before - 1  # the projections section went; the resident one stays
    del views
    gc.collect()
    assert not _mappings(path)


def test_a_stale_file_is_rebuilt(tmp_path: Path) -> None:
    layout = WeightLayout.of(SHAPES, torch.float32)
    path, calls = tmp_path / "m.weights", list[str]()
    old = open_weight_file(path, "old-key", layout, _filler(_values(layout, 2), calls))
    new_values = _values(layout, 3)
    new = open_weight_file(path, "new-key", layout, _filler(new_values, calls))
    assert calls == ["fill", "fill"]
    torch.testing.assert_close(new["qkv"], new_values["qkv"], rtol=0, atol=0)
    assert not torch.equal(old["qkv"], new["qkv"])  # the old mapping still reads the old (unlinked) file
    path.write_bytes(path.read_bytes()[:100])  # truncated: not the file the header promises
    again = open_weight_file(path, "new-key", layout, _filler(new_values, calls))
    assert calls == ["fill"] * 3 and torch.equal(again["embed"], new_values["embed"])


def test_racing_builders_end_on_one_file(tmp_path: Path) -> None:
    """A second builder that gave up waiting for the lock links its file while the first is still filling: the
    first maps the winner's file."""
    layout = WeightLayout.of(SHAPES, torch.float32)
    path, winner, loser = tmp_path / "m.weights", _values(layout, 4), _values(layout, 5)

    def fill_then_lose(views: dict[str, torch.Tensor]) -> None:
        for name, view in views.items():
            view.copy_(loser[name])
        open_weight_file(path, "k", layout, _filler(winner, []), lock_wait_s=0.0)

    views = open_weight_file(path, "k", layout, fill_then_lose)
    for name, expected in winner.items():
        torch.testing.assert_close(views[name], expected, rtol=0, atol=0)
    assert sorted(os.listdir(tmp_path)) == [".m.weights.lock", "m.weights"]


def test_a_process_waits_for_the_one_converting(tmp_path: Path) -> None:
    """While another holds the lock, a process waits; it then maps the file that one built, converting nothing."""
    layout = WeightLayout.of(SHAPES, torch.float32)
    path, values = tmp_path / "m.weights", _values(layout, 6)
    holder = os.open(tmp_path / ".m.weights.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # the converting process
    calls: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(open_weight_file, path, "k", layout, _filler(values, calls), 30.0)
        open_weight_file(path, "k", layout, _filler(values, []), lock_wait_s=0.0)  # what the holder writes
        assert not waiting.done()  # still waiting for the lock, though the file is there
        os.close(holder)
        views = waiting.result(timeout=30)
    assert calls == [] and torch.equal(views["qkv"], values["qkv"])


def test_a_failed_fill_leaves_no_file(tmp_path: Path) -> None:
    layout = WeightLayout.of(SHAPES, torch.float32)

    def broken(views: dict[str, torch.Tensor]) -> None:
        raise ValueError("checkpoint tensor missing")

    with pytest.raises(ValueError, match="checkpoint tensor missing"):
        open_weight_file(tmp_path / "m.weights", "k", layout, broken)
    assert os.listdir(tmp_path) == [".m.weights.lock"]


def test_the_key_names_the_source_files_and_layout(tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x" * 10)
    layout = WeightLayout.of(SHAPES, torch.float32)
    key = cache_key([source], layout)
    assert key == cache_key([source], layout)
    assert key != cache_key([source], WeightLayout.of(SHAPES, torch.bfloat16))
    source.write_bytes(b"y" * 11)
    assert key != cache_key([source], layout)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.sampled_from(SECTIONS)),
                min_size=1, max_size=6),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_any_layout_round_trips(tmp_path_factory: pytest.TempPathFactory,
                                specs: list[tuple[list[int], str]], dtype: torch.dtype) -> None:
    layout = WeightLayout.of([(f"t{i}", tuple(shape), section) for i, (shape, section) in enumerate(specs)], dtype)
    assert all(slot.offset % 64 == 0 for slot in layout.slots)
    values = _values(layout, len(specs))
    views = open_weight_file(tmp_path_factory.mktemp("w") / "m.weights", "k", layout,
                             _filler(values, []))
    for name, expected in values.items():
        assert views[name].dtype == dtype and torch.equal(views[name], expected)
