"""A tensor-parallel rank's part of a GGUF file: read and dequantized for its part only (rows, or the Q8_0 blocks
holding its columns; columns off block boundaries cut from dequantized rows), equal to the same part of the whole
tensor, and a rank loaded from GGUF holds what the same rank loaded from the safetensors it was written from
holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncaked.model.loader import load_model
from mooncaked.model.tensor_parallel import shard_shape
from mooncaked.model.weights_gguf import GGUFModelFile
from tests.model.family_checkpoints import CASES, random_hf_model, write_gguf, write_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CASE = next(c for c in CASES if c.case_id == "llama2-mha")  # hidden 64, MLP 96, 4 heads of 16: llama's Q/K order


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """(the transformers model, its GGUF in fp32, its GGUF with Q8_0 matrices)."""
    folder = tmp_path_factory.mktemp("gguf-shards")
    model = random_hf_model(CASE, seed=5)
    write_gguf(model, folder / "f32.gguf", "llama")
    write_gguf(model, folder / "q8_0.gguf", "llama", is_q8_0=True)
    return model, folder / "f32.gguf", folder / "q8_0.gguf"


@st.composite
def _pieces(draw: st.DrawFn, shapes: dict[str, tuple[int, ...]], head_dim: int) -> dict[str, tuple[int, int, int]]:
    """Up to four tensors' (dim, start, length): Q/K rows by whole heads (llama's row order is per head), any other
    range elsewhere, Q8_0 block boundaries or not."""
    names = draw(st.lists(st.sampled_from(sorted(shapes)), min_size=1, max_size=4, unique=True))
    pieces = {}
    for name in names:
        shape = shapes[name]
        dim = draw(st.integers(0, len(shape) - 1))
        unit = head_dim if dim == 0 and name.endswith(("q_proj.weight", "k_proj.weight")) else 1
        start = draw(st.integers(0, shape[dim] // unit - 1))
        length = draw(st.integers(1, shape[dim] // unit - start))
        pieces[name] = (dim, start * unit, length * unit)
    return pieces


@pytest.mark.parametrize("quantized", [False, True])
def test_a_slice_read_from_a_gguf_equals_the_same_slice_of_the_whole(files: tuple[Any, Path, Path],
                                                                     quantized: bool) -> None:
    gguf_file = GGUFModelFile.open(files[2] if quantized else files[1])
    whole = gguf_file.hf_state_dict()
    shapes = {name: tuple(tensor.shape) for name, tensor in whole.items()}

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(pieces=_pieces(shapes, gguf_file.model_args().head_dim))
    def check(pieces: dict[str, tuple[int, int, int]]) -> None:
        for name, tensor in gguf_file.iter_hf_tensors(pieces):
            if name in pieces:
                dim, start, length = pieces[name]
                assert torch.equal(tensor, whole[name].narrow(dim, start, length)), (name, pieces[name])
            else:
                assert torch.equal(tensor, whole[name])

    check()


def test_a_rank_loaded_from_gguf_holds_what_it_holds_from_safetensors(files: tuple[Any, Path, Path], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model, f32, _ = files
    model.save_pretrained(tmp_path)
    write_tokenizer(CASE, tmp_path)
    args = load_model(str(f32), packing="plain").args
    asked: list[int] = []  # how many tensors each read of the file was asked to slice
    read = GGUFModelFile.iter_hf_tensors
    monkeypatch.setattr(GGUFModelFile, "iter_hf_tensors",
                        lambda self, slices=None: asked.append(len(slices or {})) or read(self, slices))
    for rank in range(2):
        shard = shard_shape(args, rank, 2)
        from_gguf = load_model(str(f32), packing="plain", shard=shard).model
        from_safetensors = load_model(str(tmp_path), packing="plain", shard=shard).model
        ours, theirs = from_gguf.state_dict(), from_safetensors.state_dict()
        assert ours.keys() == theirs.keys() and from_gguf.weight_slices()
        for name in ours:
            np.testing.assert_array_equal(ours[name].numpy(), theirs[name].numpy(), err_msg=name)
    assert len(asked) == 2 and all(asked)  # each rank read its slices, not the whole tensors
