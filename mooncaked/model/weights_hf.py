"""Hugging Face checkpoint directories: `config.json` plus one or many `*.safetensors`, read memory-mapped.

1. `read_hf_config(dir)` parses `config.json` into ModelArgs (model.families refuses what we cannot run);
   `read_fp8_format(dir)` its block FP8 quantization, if any (model.fp8_blocks).
2. `SafetensorsCheckpoint.open(dir, fp8)` finds the shards (`model.safetensors.index.json` when present, else
   every `*.safetensors`) and reads only their headers: tensor names, shapes, dtypes.
3. `check(args)` compares those with the tensors the model needs, before any weight memory is allocated; in an
   FP8 checkpoint each F8_E4M3 weight needs its `weight_scale_inv` of the block grid's shape.
4. `iter_tensors(progress, slices)` yields (name, tensor) one at a time from safetensors' `safe_open` memory
   map, so the copy into the model is the only read and peak memory is the model plus one tensor; a
   tensor-parallel rank reads only its slices of the sharded projections. An FP8 weight comes dequantized
   (fp32, times its blocks' scales, read beside it); its scale tensor is not yielded.
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
from mooncaked.model.fp8_blocks import FP8_DTYPE, SCALE_SUFFIX, Fp8BlockFormat, dequantize, fp8_format, scale_shape
from mooncaked.model.load_progress import LoadProgress
from mooncaked.model.tensor_parallel import Slice
from mooncaked.model.weight_names import CheckpointError, check_complete, check_tensor, hf_tensor_shapes, is_ignored

# safetensors dtype names of floating-point weights, and their sizes
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def read_hf_config(model_dir: Path) -> ModelArgs:
    config, config_path = _read_config_json(model_dir)
    try:
        return args_from_hf_config(config)
    except ValueError as exc:
        raise type(exc)(f"{config_path}: {exc}") from exc


def read_fp8_format(model_dir: Path) -> Fp8BlockFormat | None:
    """The block FP8 format of a checkpoint whose config read_hf_config accepted; None: unquantized."""
    config, _ = _read_config_json(model_dir)
    quantization = config.get("quantization_config")
    return None if quantization is None else fp8_format(quantization)


def _read_config_json(model_dir: Path) -> tuple[Any, Path]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; a Hugging Face checkpoint directory needs one")
    try:
        return json.loads(config_path.read_text()), config_path
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from exc


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
    fp8: Fp8BlockFormat | None = None  # block FP8 weights (with scale tensors); None: float weights only

    @classmethod
    def open(cls, model_dir: Path, fp8: Fp8BlockFormat | None = None) -> SafetensorsCheckpoint:
        files = shard_files(model_dir)
        shards = {path: _read_header(path) for path in files}
        checkpoint = cls(model_dir, shards, fp8)
        checkpoint._check_index()
        return checkpoint

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for entries in self.shards.values() for e in entries)

    def check(self, args: ModelArgs) -> None:
        """CheckpointError unless the shards hold exactly the tensors a model of `args` needs, in float dtypes."""
        expected = hf_tensor_shapes(args)
        seen: list[str] = []
        fp8_weights: list[TensorEntry] = []
        for path, entries in self.shards.items():
            for entry in entries:
                if is_ignored(entry.name, args) or (self.fp8 is not None and entry.name.endswith(SCALE_SUFFIX)):
                    continue  # a scale is checked with its weight
                check_tensor(entry.name, entry.shape, expected, path.name)
                if entry.dtype == FP8_DTYPE and self.fp8 is not None:
                    fp8_weights.append(entry)
                elif entry.dtype not in _FLOAT_DTYPES:
                    raise CheckpointError(f"{path.name}: tensor {entry.name!r} has dtype {entry.dtype}; only "
                                          f"unquantized {', '.join(_FLOAT_DTYPES)} weights, or {FP8_DTYPE} ones of "
                                          "a block-quantized checkpoint (quantization_config), are supported")
                if entry.name in seen:
                    raise CheckpointError(f"{self.model_dir}: tensor {entry.name!r} is in more than one shard")
                seen.append(entry.name)
        check_complete(seen, expected, str(self.model_dir))
        if self.fp8 is not None:
            self._check_scales(fp8_weights, self.fp8)

    def _check_scales(self, fp8_weights: list[TensorEntry], fmt: Fp8BlockFormat) -> None:
        """Each FP8 weight has a float scale of its block grid's shape, and each scale an FP8 weight."""
        scales = {e.name: e for entries in self.shards.values() for e in entries if e.name.endswith(SCALE_SUFFIX)}
        for weight in fp8_weights:
            scale = scales.pop(weight.name + SCALE_SUFFIX, None)
            if len(weight.shape) != 2:
                raise CheckpointError(f"{self.model_dir}: FP8 tensor {weight.name!r} has shape {weight.shape}; only "
                                      "2-D weights are block-quantized")
            if scale is None:
                raise CheckpointError(f"{self.model_dir}: FP8 tensor {weight.name!r} has no "
                                      f"{weight.name + SCALE_SUFFIX!r}; the checkpoint is incomplete")
            implied = scale_shape(weight.shape, fmt)
            if scale.shape != implied or scale.dtype not in _FLOAT_DTYPES:
                raise CheckpointError(
                    f"{self.model_dir}: tensor {scale.name!r} has shape {scale.shape} ({scale.dtype}); "
                    f"weight_block_size [{fmt.block_rows}, {fmt.block_cols}] over {weight.name!r} {weight.shape} "
                    f"implies a float scale of shape {implied}")
        if scales:
            name = next(iter(scales))
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} scales "
                                  f"{name.removesuffix(SCALE_SUFFIX)!r}, which is not an FP8 weight of this model")

    def iter_tensors(self, progress: LoadProgress | None = None,
                     slices: Mapping[str, Slice] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, one memory-mapped tensor at a time, in shard order; a tensor `slices` names
        comes as that (dim, start, length) slice, reading only its bytes (a tensor-parallel rank's part)."""
        slices = slices or {}
        scale_shards = {e.name: path for path, entries in self.shards.items() for e in entries
                        if self.fp8 is not None and e.name.endswith(SCALE_SUFFIX)}
        for path, entries in self.shards.items():
            with _open_shard(path) as shard:
                for entry in entries:
                    piece = slices.get(entry.name)
                    if self.fp8 is not None and entry.dtype == FP8_DTYPE:
                        scale_name = entry.name + SCALE_SUFFIX
                        scale = _read_scale(shard if scale_shards[scale_name] == path else None,
                                            scale_shards[scale_name], scale_name)
                        yield entry.name, _dequantized(shard, entry, piece, scale, self.fp8)
                    elif self.fp8 is None or not entry.name.endswith(SCALE_SUFFIX):
                        yield entry.name, shard.get_tensor(entry.name) if piece is None else _read_slice(
                            shard, entry, piece)
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


def _read_scale(open_shard: Any, path: Path, name: str) -> torch.Tensor:
    """A scale tensor from the shard already open (`open_shard`), else from its own shard `path`."""
    if open_shard is not None:
        scale: torch.Tensor = open_shard.get_tensor(name)
        return scale
    with _open_shard(path) as shard:
        scale = shard.get_tensor(name)
        return scale


def _dequantized(shard: Any, entry: TensorEntry, piece: Slice | None, scale: torch.Tensor,
                 fmt: Fp8BlockFormat) -> torch.Tensor:
    """An FP8 weight, or its (dim, start, length) slice, in fp32."""
    weight = shard.get_tensor(entry.name) if piece is None else _read_slice(shard, entry, piece)
    dim, start, _ = piece or (0, 0, 0)
    return dequantize(weight, scale, fmt, row_start=start if dim == 0 else 0, col_start=start if dim == 1 else 0)


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
