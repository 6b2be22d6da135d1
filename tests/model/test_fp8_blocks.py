"""FP8 block-quantized checkpoints (model.fp8_blocks, model.weights_hf): block dequantization of whole tensors and
of tensor-parallel slices, a checkpoint this test writes in FP8 giving the logits of the dequantized model, FP8's
error against the unquantized weights within its bound, and damaged scales named at load.

The bound: a block's scale is amax / 448 (e4m3's largest finite value), so every weight w is stored as
scale x q with q an e4m3 number: 3 mantissa bits give |w - scale x q| <= 2^-4 |w| for normal q, and at most half
the smallest subnormal step, scale x 2^-10, below them (checked per weight). Through the tiny three-layer MoE model
that moves the logits by 5.6% of their RMS against the unquantized checkpoint; the FP8 checkpoint's logits equal
those of its dequantized weights to 1e-4 (fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mooncaked.engine.batch import PrefillSeq, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.families import UnsupportedModel, args_from_hf_config
from mooncaked.model.fp8_blocks import Fp8BlockFormat, dequantize
from mooncaked.model.loader import LoadedModel, load_model
from mooncaked.model.tensor_parallel import shard_shape
from mooncaked.model.weight_names import CheckpointError
from tests.model.family_checkpoints import CASES, hf_config, write_checkpoint

transformers = pytest.importorskip("transformers")

MOE = next(c for c in CASES if c.model_type == "qwen3_moe")  # hidden 64, experts of 32 columns, q 64 / kv 32 rows
BLOCK = Fp8BlockFormat(32, 32)
FP8_MAX = 448.0
PROMPT = [3 + (7 * i) % 250 for i in range(21)]


def quantize(weight: torch.Tensor, fmt: Fp8BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """weight fp32 [R, C] -> (e4m3 [R, C], fp32 scale_inv [ceil(R / rows), ceil(C / cols)]): DeepSeek's recipe."""
    rows, cols = weight.shape
    num_rb, num_cb = -(-rows // fmt.block_rows), -(-cols // fmt.block_cols)
    padded = torch.zeros(num_rb * fmt.block_rows, num_cb * fmt.block_cols)
    padded[:rows, :cols] = weight
    blocks = padded.view(num_rb, fmt.block_rows, num_cb, fmt.block_cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [RB, CB]
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view_as(padded)[:rows, :cols]
    return quantized.contiguous(), scale


def _is_quantized(name: str) -> bool:
    """DeepSeek-V3 leaves the embedding, the output head, norms and the router unquantized."""
    return name.endswith("proj.weight")


def write_fp8_checkpoint(path: Path, fmt: Fp8BlockFormat, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """MOE's checkpoint with every projection in FP8; returns transformers' model and the dequantized weights."""
    hf = write_checkpoint(MOE, path, seed=seed)
    state = load_file(str(path / "model.safetensors"))
    dequantized: dict[str, torch.Tensor] = {}
    for name in [n for n in state if _is_quantized(n)]:
        state[name], state[name + "_scale_inv"] = quantize(state[name], fmt)
        dequantized[name] = state[name].float() * state[name + "_scale_inv"].repeat_interleave(
            fmt.block_rows, 0).repeat_interleave(fmt.block_cols, 1)[:state[name].shape[0], :state[name].shape[1]]
    save_file(state, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [fmt.block_rows, fmt.block_cols]}
    (path / "config.json").write_text(json.dumps(config))
    return hf, dequantized


def _logits(loaded: LoadedModel) -> torch.Tensor:
    kv = KVPages.for_model(loaded.args, num_pages=4, block_size=8, dtype=torch.float32, device="cpu")
    pages = PageAllocator(4).allocate(3, "seq")
    batch = build_prefill_batch([PrefillSeq(PROMPT, 0, pages)], block_size=8, num_pages=4, device="cpu")
    return ModelRunner(loaded.model, kv, backend="torch").prefill(batch, return_all_logits=True)


def test_block_dequantization_of_whole_tensors_and_slices_within_fp8s_bound() -> None:
    weight = torch.randn(70, 50, generator=torch.Generator().manual_seed(0))
    fmt = Fp8BlockFormat(32, 16)  # partial blocks on both edges
    quantized, scale = quantize(weight, fmt)
    whole = dequantize(quantized, scale, fmt)
    expanded = scale.repeat_interleave(32, 0)[:70].repeat_interleave(16, 1)[:, :50]
    assert torch.equal(whole, quantized.float() * expanded)
    assert (whole - weight).abs().le(2**-4 * weight.abs() + expanded * 2**-10).all()
    rows = dequantize(quantized[10:45], scale, fmt, row_start=10)  # a tensor-parallel rank's rows
    cols = dequantize(quantized[:, 5:37], scale, fmt, col_start=5)  # its columns
    assert torch.equal(rows, whole[10:45]) and torch.equal(cols, whole[:, 5:37])


def test_fp8_checkpoint_gives_the_dequantized_models_logits(tmp_path: Path) -> None:
    hf, dequantized = write_fp8_checkpoint(tmp_path, BLOCK, seed=3)
    original = {name: t.clone() for name, t in hf.state_dict().items()}
    with torch.no_grad():
        unquantized_logits = hf(torch.tensor([PROMPT])).logits[0]
        _load_per_expert(hf, dequantized)
        expected = hf(torch.tensor([PROMPT])).logits[0]
    logits = _logits(load_model(str(tmp_path), packing="plain"))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    # FP8's own error against the unquantized model (each weight within the bound above): measured here, the
    # logits' RMS deviation is 5.6% of their RMS (max 0.11 on logits up to 1.5; three layers of random weights)
    relative_rms = float((logits - unquantized_logits).norm() / unquantized_logits.norm())
    assert relative_rms < 0.1
    assert any(not torch.equal(original[n], t) for n, t in hf.state_dict().items())


def _load_per_expert(hf: Any, dequantized: dict[str, torch.Tensor]) -> None:
    """Put checkpoint-named weights into transformers' model (its experts are fused: gate_up [E, 2I, H], down
    [E, H, I])."""
    params = dict(hf.named_parameters())
    for name, tensor in dequantized.items():
        parts = name.split(".")  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
        if "experts" not in parts:
            params[name].copy_(tensor)
            continue
        experts, expert, proj = ".".join(parts[:5]), int(parts[5]), parts[6]
        if proj == "down_proj":
            params[f"{experts}.down_proj"][expert].copy_(tensor)
        else:
            inter = tensor.shape[0]
            rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            params[f"{experts}.gate_up_proj"][expert, rows].copy_(tensor)


def test_a_tensor_parallel_rank_dequantizes_its_slices(tmp_path: Path) -> None:
    """KV rows 16-31 of rank 1 start mid-block: its slice takes the scales of the block it starts in."""
    write_fp8_checkpoint(tmp_path, BLOCK, seed=4)
    whole = load_model(str(tmp_path), packing="plain")
    for rank in range(2):
        shard = shard_shape(whole.args, rank, 2)
        part = load_model(str(tmp_path), packing="plain", shard=shard)
        layer, full = part.model.layers[1], whole.model.layers[1]
        k_rows = slice(whole.args.q_size + 16 * rank, whole.args.q_size + 16 * (rank + 1))
        torch.testing.assert_close(layer.qkv_proj.weight_t[:, 32:48], full.qkv_proj.weight_t[:, k_rows])
        sparse, full_sparse = part.model.layers[2].moe, whole.model.layers[2].moe
        torch.testing.assert_close(sparse.experts_down, full_sparse.experts_down[:, 16 * rank:16 * (rank + 1)])


def _damage(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    state = load_file(str(path / "model.safetensors"))
    for name, tensor in edit.items():
        if tensor is None:
            del state[name]
        else:
            state[name] = tensor
    save_file(state, str(path / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    ({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 3)},
     r"'model.layers.0.self_attn.q_proj.weight_scale_inv' has shape \(2, 3\) \(F32\); weight_block_size \[32, 32\] "
     r"over 'model.layers.0.self_attn.q_proj.weight' \(64, 64\) implies a float scale of shape \(2, 2\)"),
    ({"model.layers.2.mlp.experts.3.up_proj.weight_scale_inv": None},
     "FP8 tensor 'model.layers.2.mlp.experts.3.up_proj.weight' has no "
     "'model.layers.2.mlp.experts.3.up_proj.weight_scale_inv'"),
    ({"model.norm.weight_scale_inv": torch.ones(1, 1)},
     "'model.norm.weight_scale_inv' scales 'model.norm.weight', which is not an FP8 weight"),
    ({"model.layers.1.mlp.down_proj.weight_scale_inv": torch.ones(2, 3, dtype=torch.int32)},
     r"down_proj.weight_scale_inv' has shape \(2, 3\) \(I32\)"),
], ids=["mis-shaped-scale", "missing-scale", "scale-of-an-unquantized-tensor", "integer-scale"])
def test_damaged_scales_are_named_at_load(tmp_path: Path, edit: dict[str, torch.Tensor | None],
                                          message: str) -> None:
    write_fp8_checkpoint(tmp_path, BLOCK, seed=5)
    _damage(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(str(tmp_path))


def test_fp8_weights_without_quantization_config_are_named(tmp_path: Path) -> None:
    write_fp8_checkpoint(tmp_path, BLOCK, seed=6)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has dtype F8_E4M3; only unquantized"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8 without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
])
def test_other_quantizations_are_refused_by_name(quantization: dict[str, Any], message: str) -> None:
    config = hf_config(MOE).to_dict()
    with pytest.raises(UnsupportedModel, match=message):
        args_from_hf_config({**config, "quantization_config": quantization})
