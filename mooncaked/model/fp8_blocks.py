"""FP8 block-quantized checkpoints (DeepSeek-V3, Kimi K2): e4m3 weights, one fp32 scale per block, dequantized
while streaming.

1. `fp8_format(quantization_config)` reads config.json's `quantization_config` (`quant_method: fp8`,
   `weight_block_size: [rows, columns]`, `fmt: e4m3`) into Fp8BlockFormat; model.families refuses every other
   method, and FP8 without block scales, by name.
2. At header time (model.weights_hf) every F8_E4M3 tensor `X.weight` [out, in] needs `X.weight_scale_inv` of shape
   `scale_shape(...)` = [ceil(out / rows), ceil(in / columns)]; a missing or mis-shaped scale is named.
3. `dequantize(weight, scale_inv, format, row_start, col_start)`: an fp8 weight (or a tensor-parallel rank's slice
   of it, starting at row_start / col_start of the whole) times the scale of each block it covers, in fp32. The
   weight's blocks broadcast against the scales (no expanded scale tensor): peak memory is one fp32 copy of the
   weight, padded to whole blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = "F8_E4M3"  # safetensors' name of torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


class Fp8FormatError(ValueError):
    """quantization_config names FP8 in a form mooncaked does not read; the message names the field."""


@dataclass(frozen=True)
class Fp8BlockFormat:
    block_rows: int
    block_cols: int


def fp8_format(quantization_config: Mapping[str, Any]) -> Fp8BlockFormat:
    """quantization_config of `quant_method: fp8` -> its block format; Fp8FormatError for what is not block FP8."""
    block = quantization_config.get("weight_block_size")
    if block is None:
        raise Fp8FormatError("quantization_config: fp8 without weight_block_size (per-tensor or per-channel scales) "
                             "is not supported; only block-quantized FP8 as DeepSeek-V3 ships it, e.g. "
                             "weight_block_size [128, 128]")
    if (not isinstance(block, list) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
        raise Fp8FormatError(f"quantization_config: weight_block_size must be two positive integers, got {block!r}")
    fmt = quantization_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise Fp8FormatError(f"quantization_config: fmt {fmt!r} is not supported; only 'e4m3'")
    return Fp8BlockFormat(block[0], block[1])


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(weight_shape: tuple[int, ...], fmt: Fp8BlockFormat) -> tuple[int, int]:
    """The scale tensor a 2-D [out, in] fp8 weight needs: one scale per (block_rows x block_cols) block."""
    rows, cols = weight_shape
    return -(-rows // fmt.block_rows), -(-cols // fmt.block_cols)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8BlockFormat, row_start: int = 0,
               col_start: int = 0) -> torch.Tensor:
    """weight fp8 [R, C] (rows row_start.., columns col_start.. of the whole tensor), scale_inv [whole blocks] ->
    fp32 [R, C] = weight x the scale of its block."""
    num_rows, num_cols = weight.shape
    b_rows, b_cols = fmt.block_rows, fmt.block_cols
    row_pad, col_pad = row_start % b_rows, col_start % b_cols
    num_row_blocks = -(-(row_pad + num_rows) // b_rows)
    num_col_blocks = -(-(col_pad + num_cols) // b_cols)
    first_row_block, first_col_block = row_start // b_rows, col_start // b_cols
    scales = scale_inv[first_row_block:first_row_block + num_row_blocks,
                       first_col_block:first_col_block + num_col_blocks].float()  # [RB, CB]
    padded = torch.zeros(num_row_blocks * b_rows, num_col_blocks * b_cols, dtype=torch.float32)
    piece = padded[row_pad:row_pad + num_rows, col_pad:col_pad + num_cols]
    piece.copy_(weight)
    padded.view(num_row_blocks, b_rows, num_col_blocks, b_cols).mul_(scales[:, None, :, None])
    return piece
