"""Hugging Face checkpoint directories: `config.json` plus one or many `*.safetensors`, read memory-mapped.

1. `read_hf_config(dir)` parses `config.json` into ModelArgs (model.families refuses what we cannot run).
2. `SafetensorsCheckpoint.open(dir)` finds the shards (`model.safetensors.index.json` when present, else every
   `*.safetensors`) and reads only their headers: tensor names, shapes, dtypes.
3. `check(args)` compares those with the tensors the model needs, before any weight memory is allocated.
4. `iter_tensors(progress, slices)` yields (name, tensor) one at a time from safetensors' `safe_open` memory
   map, so the copy into the model is the only read and peak memory is the model plus one tensor; a
   tensor-parallel rank reads only its slices of the sharded projections.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mooncaked.model.config import ModelArgs
from mooncaked.model.families import ConfigError, args_from_hf_config
from mooncaked.model.load_progress import LoadProgress
from mooncaked.model.tensor_parallel import Slice
from mooncaked.model.weight_names import CheckpointError, check_complete, check_tensor, hf_tensor_shapes, is_ignored

# safetensors dtype names of floating-point weights, and their sizes
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def read_hf_config(model_dir: Path) -> ModelArgs:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; a Hugging Face checkpoint directory needs one")
    try:
        config: Any = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from exc
    try:
        return args_from_hf_config(config)
    except ValueError as exc:
        raise type(exc)(f"{config_path}: {exc}") from exc


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "BF16"
    nbytes: int


@dataclass(frozen=True)
class SafetensorsCheckpoint:
    """The shard files of a checkpoint directory and their tensor headers; immutable, reads data only on demand."""

    model_dir: Path
    shards: dict[Path, list[TensorEntry]]

    @classmethod
    def open(cls, model_dir: Path) -> SafetensorsCheckpoint:
        files = shard_files(model_dir)
        shards = {path: _read_header(path) for path in files}
        checkpoint = cls(model_dir, shards)
        checkpoint._check_index()
        return checkpoint

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for entries in self.shards.values() for e in entries)

    def check(self, args: ModelArgs) -> None:
        """CheckpointError unless the shards hold exactly the tensors a model of `args` needs, in float dtypes."""
        expected = hf_tensor_shapes(args)
        seen: list[str] = []
        for path, entries in self.shards.items():
            for entry in entries:
                if is_ignored(entry.name, args):
                    continue
                check_tensor(entry.name, entry.shape, expected, path.name)
                if entry.dtype not in _FLOAT_DTYPES:
                    raise CheckpointError(f"{path.name}: tensor {entry.name!r} has dtype {entry.dtype}; only "
                                          f"unquantized {', '.join(_FLOAT_DTYPES)} weights are supported")
                if entry.name in seen:
                    raise CheckpointError(f"{self.model_dir}: tensor {entry.name!r} is in more than one shard")
                seen.append(entry.name)
        check_complete(seen, expected, str(self.model_dir))

    def iter_tensors(self, progress: LoadProgress | None = None,
                     slices: Mapping[str, Slice] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, one memory-mapped tensor at a time, in shard order; a tensor `slices` names
        comes as that (dim, start, length) slice, reading only its bytes (a tensor-parallel rank's part)."""
        slices = slices or {}
        for path, entries in self.shards.items():
            with _open_shard(path) as shard:
                for entry in entries:
                    piece = slices.get(entry.name)
                    yield entry.name, shard.get_tensor(entry.name) if piece is None else _read_slice(shard, entry,
                                                                                                     piece)
                    if progress is not None:
                        progress.advance(entry.nbytes, time.monotonic())

    def _check_index(self) -> None:
        index_path = self.model_dir / INDEX_NAME
        if not index_path.is_file():
            return
        held = {e.name: path.name for path, entries in self.shards.items() for e in entries}
        for name, file_name in _weight_map(index_path).items():
            if held.get(name) != file_name:
                raise CheckpointError(f"{index_path}: tensor {name!r} is indexed in {file_name} but that shard "
                                      "does not hold it; the checkpoint is incomplete or corrupt")


INDEX_NAME = "model.safetensors.index.json"


def shard_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / INDEX_NAME
    if index_path.is_file():
        files = [model_dir / name for name in sorted(set(_weight_map(index_path).values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index_path} names shards that are missing: {missing[:5]}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    return files


def _weight_map(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: {exc}") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: weight_map must map tensor names to shard file names")
    return weight_map


def _read_slice(shard: Any, entry: TensorEntry, piece: Slice) -> torch.Tensor:
    dim, start, length = piece
    if not 0 <= dim < len(entry.shape) or start + length > entry.shape[dim]:
        raise CheckpointError(f"tensor {entry.name!r} of shape {entry.shape} has no slice {piece}")
    index = (slice(None),) * dim + (slice(start, start + length),)
    tensor: torch.Tensor = shard.get_slice(entry.name)[index]
    return tensor


def _open_shard(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc


def _read_header(path: Path) -> list[TensorEntry]:
    entries = []
    with _open_shard(path) as shard:
        for name in shard.keys():
            tensor_slice = shard.get_slice(name)
            shape = tuple(int(d) for d in tensor_slice.get_shape())
            dtype = str(tensor_slice.get_dtype())
            numel = 1
            for dim in shape:
                numel *= dim
            entries.append(TensorEntry(name, shape, dtype, numel * _FLOAT_DTYPES.get(dtype, 1)))
    return entries
