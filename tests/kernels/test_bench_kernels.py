"""`mooncaked bench kernels`: refuses cleanly without a GPU; its measurements run on CPU in the interpreter."""

import argparse
import time
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from triton.runtime.errors import OutOfResources
from hypothesis import strategies as st

from mooncaked.bench import kernels as bench
from mooncaked.kernels import reference
from tests.triton_mode import needs_triton_interpreter


def _once_ms(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


SETUP = bench.Setup(
    device=torch.device("cpu"), dtype=torch.float32, heads=4, kv_heads=2, head_dim=16, block_size=16,
    time_ms=_once_ms,
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_cuda_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--prefill-tokens", "64"])) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_int_list_is_rejected() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-batches", "1,x"])


def test_prefill_tiles_parse_or_are_refused_by_name() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    tiles = parser.parse_args(["--prefill-tiles", "128x128x8x3, 64x64x4x1"]).prefill_tiles
    assert [bench._tiles_name(t) for t in tiles] == ["128x128x8x3", "64x64x4x1"]


@given(st.text(alphabet="0123456789x, -.", max_size=30))
def test_any_prefill_tiles_text_parses_to_positive_shapes_or_an_argument_error(text: str) -> None:
    try:
        tiles = bench._tiles_list(text)
    except argparse.ArgumentTypeError as exc:
        assert "BLOCK_MxBLOCK_NxWARPSxSTAGES" in str(exc) or "at least one tile shape" in str(exc)
        return
    assert tiles and all(min(t.block_m, t.block_n, t.num_warps, t.num_stages) > 0 for t in tiles)


def test_paged_kv_lays_out_every_sequence() -> None:
    k, v = torch.randn(2, 45, 2, 16), torch.randn(2, 45, 2, 16)
    k_pages, v_pages, block_tables = bench.paged_kv(k, v, block_size=16)
    assert k_pages.shape == (6, 16, 2, 16) and block_tables.shape == (2, 3)
    for s in range(2):
        assert torch.equal(reference.gather_pages(k_pages, block_tables[s], 45), k[s])
        assert torch.equal(reference.gather_pages(v_pages, block_tables[s], 45), v[s])


@needs_triton_interpreter
def test_prefill_and_decode_measurements_agree_with_baselines() -> None:
    row = bench.bench_prefill(SETUP, seq_len=40, prefix_fraction=0.5)
    assert row["num_cached"] == 20 and row["max_abs_err_vs_sdpa"] < 1e-4 and row["ratio"] > 0
    row = bench.bench_decode(SETUP, batch=2, context=40)
    assert row["max_abs_err_vs_reference"] < 1e-4 and row["bandwidth_gb_s"] > 0


def test_a_tile_shape_too_big_for_the_device_is_skipped_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    def too_big(*_: object) -> dict[str, object]:
        raise OutOfResources(300_000, 232_448, "shared memory")

    tiles = bench._tiles_list("256x128x16x2")[0]
    assert bench._fitting(too_big, SETUP, 64, 0.0, tiles) == []
    assert "prefill tiles 256x128x16x2 do not fit this device" in capsys.readouterr().err
    assert bench._fitting(lambda *_: {"ratio": 1.0}, SETUP, 64, 0.0, tiles) == [{"ratio": 1.0}]
