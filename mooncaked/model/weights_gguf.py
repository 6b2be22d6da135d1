"""GGUF files (llama.cpp format) of the `llama` (Llama 2/3, Mistral), `qwen2` and `qwen3` architectures.

1. `GGUFModelFile.open(path)` parses the header: key/value metadata (hyperparameters, tokenizer, chat template)
   and the tensor directory, then memory-maps the data (nothing is dequantized yet). The header is parsed here
   rather than by `gguf.GGUFReader`, which builds a numpy view per vocabulary string and takes ~10 s on it.
2. `model_args()` maps `<arch>.*` metadata to ModelArgs (model.gguf_args); other architectures are refused.
3. `iter_hf_tensors(slices)` dequantizes one tensor at a time to fp32 (`gguf.quants.dequantize` handles
   F32/F16/Q4_x/Q8_0/K-quants) under its Hugging Face name, undoing the Q/K row permutation llama.cpp applies
   to `llama` files only (its qwen2/qwen3 graphs rotate the Hugging Face "rotate half" layout directly; the
   permutation stays within each head, so a slice of whole heads unpermutes alone). A tensor `slices` names (a
   tensor-parallel rank's part) is read and dequantized for that part only: its rows, or for a column slice
   the quantization blocks holding its columns (every row stores its blocks in column order); a column slice
   not on block boundaries is cut from the dequantized rows. A `rope_freqs` tensor is not a weight: it becomes
   ModelArgs.rope_freq_factors.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf.quants import dequantize

from mooncaked.model.config import ModelArgs
from mooncaked.model.gguf_args import ROPE_FREQS, args_from_gguf
from mooncaked.model.tensor_parallel import Slice

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a llama, qwen2 or qwen3 model")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of Q/K rows: [heads, 2, D/2] -> [heads, D/2, 2] row order."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# GGUF metadata value types (gguf.constants.GGUFValueType) -> struct format of a scalar
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first (GGUF stores dims innermost first)
    qtype: GGMLQuantizationType
    offset: int  # from the start of the data section


class _HeaderReader:
    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.stream.read(size))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        return self.stream.read(length).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.stream.read(size * count)))
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"GGUF metadata value type {value_type} is unknown")
        return self.scalar(_SCALAR_FORMATS[value_type])


def read_gguf_header(path: Path) -> tuple[dict[str, Any], list[GGUFTensorInfo], int]:
    """(metadata, tensor directory, absolute offset of the data section)."""
    with path.open("rb") as stream:
        reader = _HeaderReader(stream)
        if reader.scalar("<I") != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version = reader.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = reader.scalar("<Q"), reader.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        tensors = [_read_tensor_info(reader) for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        position = stream.tell()
    data_offset = (position + alignment - 1) // alignment * alignment
    return metadata, tensors, data_offset


def _read_tensor_info(reader: _HeaderReader) -> GGUFTensorInfo:
    name = reader.string()
    num_dims = reader.scalar("<I")
    dims = [reader.scalar("<Q") for _ in range(num_dims)]
    qtype = GGMLQuantizationType(reader.scalar("<I"))
    offset = reader.scalar("<Q")
    return GGUFTensorInfo(name=name, shape=tuple(reversed(dims)), qtype=qtype, offset=offset)


def _cut(weight: np.ndarray, piece: Slice) -> np.ndarray:
    dim, start, length = piece
    index = [slice(None)] * weight.ndim
    index[dim] = slice(start, start + length)
    return weight[tuple(index)]


def _raw_rows(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as uint8 [..., bytes per row], the layout gguf.quants.dequantize takes."""
    block_size, type_size = GGML_QUANT_SIZES[info.qtype]
    row_elements = info.shape[-1]
    if row_elements % block_size != 0:
        raise ValueError(f"GGUF tensor {info.name}: row of {row_elements} is not a multiple of block {block_size}")
    row_bytes = row_elements // block_size * type_size
    num_rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    raw = data[info.offset: info.offset + num_rows * row_bytes]
    return raw.reshape(*info.shape[:-1], row_bytes)


@dataclass
class GGUFModelFile:
    """A parsed GGUF header and the memory-mapped data section; read-only once opened."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data: np.ndarray  # uint8 memmap of the data section

    @classmethod
    def open(cls, path: Path) -> GGUFModelFile:
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        metadata, tensors, data_offset = read_gguf_header(path)
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_offset)
        return cls(path=path, metadata=metadata, tensors=tensors, data=data)

    def model_args(self) -> ModelArgs:
        return args_from_gguf(self.metadata, {t.name: t.shape for t in self.tensors}, self._rope_freq_factors())

    def iter_hf_tensors(self, slices: Mapping[str, Slice] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight dequantized to fp32 under its Hugging Face name, one at a time; one `slices` names as that
        (dim, start, length) slice, dequantizing only its part (stage 3)."""
        head_dim = self.model_args().head_dim
        is_permuted = self.metadata.get("general.architecture") == "llama"
        slices = slices or {}
        for info in self.tensors:
            if info.name == ROPE_FREQS:
                continue
            name = hf_tensor_name(info.name)
            weight = self._dequantize(info, slices.get(name))
            if is_permuted and name.endswith(("q_proj.weight", "k_proj.weight")):  # whole heads, sliced or not
                weight = unpermute_rope_rows(weight, weight.shape[0] // head_dim)
            if not weight.flags.writeable:  # F32 tensors are read-only views of the memmap
                weight = weight.copy()
            yield name, torch.from_numpy(np.ascontiguousarray(weight))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight at once (tests; loading streams `iter_hf_tensors`)."""
        return dict(self.iter_hf_tensors())

    @property
    def total_bytes(self) -> int:
        """Bytes of the tensors in the file (quantized as stored)."""
        return int(self.data.shape[0])

    def _dequantize(self, info: GGUFTensorInfo, piece: Slice | None = None) -> np.ndarray:
        """The tensor, or its (dim, start, length) `piece`, as fp32 [*shape]."""
        raw = _raw_rows(self.data, info)  # [..., bytes per row]: a view of the memmap, nothing read yet
        if piece is None or len(info.shape) == 1:
            whole = np.asarray(dequantize(raw, info.qtype), dtype=np.float32)
            return whole if piece is None else _cut(whole, piece)
        dim, start, length = piece
        if dim == 0:
            return np.asarray(dequantize(np.ascontiguousarray(raw[start: start + length]), info.qtype),
                              dtype=np.float32)
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        if dim != len(info.shape) - 1 or start % block_size or length % block_size:
            return _cut(np.asarray(dequantize(raw, info.qtype), dtype=np.float32), piece)
        columns = raw[..., start // block_size * type_size: (start + length) // block_size * type_size]
        return np.asarray(dequantize(np.ascontiguousarray(columns), info.qtype), dtype=np.float32)

    def _rope_freq_factors(self) -> tuple[float, ...] | None:
        for info in self.tensors:
            if info.name == ROPE_FREQS:
                return tuple(float(f) for f in self._dequantize(info).reshape(-1))
        return None
