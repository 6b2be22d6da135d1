"""The parts of CUDA-graph decode that need no GPU: buckets, padding of a step into the static inputs, and the
eager fallback (the captured graphs themselves are checked in tests/gpu/test_runner_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mooncaked.engine.batch import DecodeBatch, DecodeSeq, build_decode_batch
from mooncaked.engine.cuda_graphs import DecodeGraphs, bucket_sizes
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.loader import load_model


@given(st.integers(1, 512))
def test_buckets_cover_every_batch_size_once(max_batch_size: int) -> None:
    sizes = bucket_sizes(max_batch_size)
    assert sizes[0] == 1 and sizes[-1] == max_batch_size and sizes == sorted(set(sizes))
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:-1]))
    assert all(next(s for s in sizes if s >= n) < 2 * n for n in range(1, max_batch_size + 1))
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        bucket_sizes(0)


def test_a_step_is_padded_into_its_bucket() -> None:
    eager_calls: list[int] = []

    def eager(batch: DecodeBatch) -> torch.Tensor:
        eager_calls.append(batch.num_seqs)
        return torch.zeros(batch.num_seqs, 4)

    graphs = DecodeGraphs(eager, torch.device("cpu"), max_batch_size=6, max_blocks=4)
    assert graphs.buckets == [1, 2, 4, 6]
    seqs = [DecodeSeq(9, 20, [3, 1]), DecodeSeq(8, 5, [7]), DecodeSeq(7, 40, [0, 2, 4])]
    batch = build_decode_batch(seqs, block_size=16, num_pages=8, device="cpu")
    assert graphs.bucket_for(batch) == 4
    graphs.fill(batch, 4)
    static = graphs.static_batch(4)
    assert static.input_ids.tolist() == [9, 8, 7, 0] and static.positions.tolist() == [20, 5, 40, 0]
    assert static.slot_mapping.tolist() == [1 * 16 + 4, 7 * 16 + 5, 4 * 16 + 8, -1]  # padding writes nowhere
    assert static.seq_lens.tolist() == [21, 6, 41, 1]
    assert static.block_tables.tolist() == [[3, 1, 0, 0], [7, 0, 0, 0], [0, 2, 4, 0], [0, 0, 0, 0]]
    too_many = build_decode_batch([DecodeSeq(1, 0, [i]) for i in range(7)], block_size=16, num_pages=8, device="cpu")
    too_wide = build_decode_batch([DecodeSeq(1, 70, [0, 1, 2, 3, 4])], block_size=16, num_pages=8, device="cpu")
    assert graphs.bucket_for(too_many) is None and graphs.bucket_for(too_wide) is None
    assert graphs.run(too_many).shape == (7, 4) and graphs.run(too_wide).shape == (1, 4)
    assert eager_calls == [7, 1] and not graphs.graphs


def test_the_runner_refuses_cuda_graphs_off_cuda() -> None:
    loaded = load_model("random:tiny")
    kv = KVPages.for_model(loaded.args, num_pages=4, block_size=16, dtype=loaded.dtype, device="cpu")
    with pytest.raises(ValueError, match="cuda_graphs needs the model on CUDA with the Triton kernel backend"):
        ModelRunner(loaded.model, kv, backend="torch", cuda_graphs=True)
