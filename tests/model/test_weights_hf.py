"""Safetensors checkpoints: sharded and memory-mapped loading, damaged checkpoints named before allocation, the
fit check and the progress log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.load_progress import LoadProgress
from mooncaked.model.loader import load_model
from mooncaked.model.memory_fit import ModelDoesNotFit, check_fits, projection_bytes, weight_bytes
from mooncaked.model.presets import random_preset
from mooncaked.model.weight_names import CheckpointError, num_active_parameters, num_parameters
from mooncaked.model.weights_hf import SafetensorsCheckpoint
from tests.model.family_checkpoints import CASES, write_checkpoint

pytest.importorskip("transformers")
QWEN3 = next(c for c in CASES if c.model_type == "qwen3")
LLAMA = next(c for c in CASES if c.case_id == "llama3.1-untied-rope-llama3")
MOE = next(c for c in CASES if c.model_type == "qwen3_moe")  # 8 experts of 32 columns on layers 0 and 2
DEEPSEEK = next(c for c in CASES if c.model_type == "deepseek_v3")  # 3 layers, num_nextn_predict_layers 1


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    write_checkpoint(LLAMA, tmp_path, seed=2, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    return tmp_path


def test_sharded_checkpoint_equals_single_file(sharded: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    single = tmp_path_factory.mktemp("single")
    write_checkpoint(LLAMA, single, seed=2)
    a, b = load_model(str(sharded)), load_model(str(single))
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name


def test_bfloat16_checkpoint_loads_into_float32(tmp_path: Path) -> None:
    model = write_checkpoint(QWEN3, tmp_path, seed=3)
    path = tmp_path / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}, str(path))
    loaded = load_model(str(tmp_path))
    assert loaded.dtype == torch.float32
    q_norm = model.model.layers[1].self_attn.q_norm.weight
    assert torch.equal(loaded.model.layers[1].q_norm.weight, q_norm.to(torch.bfloat16).float())


def _rewrite(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    state = load_file(str(path))
    for name, tensor in edit.items():
        if tensor is None:
            del state[name]
        else:
            state[name] = tensor
    save_file(state, str(path))


@pytest.mark.parametrize("edit, message", [
    ({"model.layers.1.self_attn.k_norm.weight": None}, "missing 1 tensor.*model.layers.1.self_attn.k_norm.weight"),
    ({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)},
     r"'model.layers.0.mlp.up_proj.weight' has shape \(3, 3\)"),
    ({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}, "'model.layers.0.self_attn.q_proj.bias' is not part"),
    ({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 96, dtype=torch.int8)}, "has dtype I8"),
])
def test_damaged_checkpoint_is_named_before_allocation(tmp_path: Path, edit: dict[str, torch.Tensor | None],
                                                       message: str) -> None:
    write_checkpoint(QWEN3, tmp_path, seed=4)
    _rewrite(tmp_path / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(str(tmp_path))


@pytest.mark.parametrize("edit, message", [
    ({"model.layers.2.mlp.experts.5.up_proj.weight": None},
     "missing 1 tensor.*'model.layers.2.mlp.experts.5.up_proj.weight'"),
    ({"model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(64, 16)},
     r"'model.layers.0.mlp.experts.1.down_proj.weight' has shape \(64, 16\), config.json implies \(64, 32\)"),
    ({"model.layers.0.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)},
     "'model.layers.0.mlp.experts.8.gate_proj.weight' is not part"),  # a ninth expert
    ({"model.layers.1.mlp.gate.weight": torch.zeros(8, 64)}, "'model.layers.1.mlp.gate.weight' is not part"),
    ({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 64, 64)}, "'model.layers.0.mlp.experts.gate_up_proj' "
                                                                          "is not part"),  # fused in-memory layout
], ids=["missing-expert", "mis-shaped-expert", "extra-expert", "router-on-a-dense-layer", "fused-experts"])
def test_damaged_moe_checkpoint_is_named_before_allocation(tmp_path: Path, edit: dict[str, torch.Tensor | None],
                                                           message: str) -> None:
    write_checkpoint(MOE, tmp_path, seed=4)
    _rewrite(tmp_path / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(str(tmp_path))


def test_deepseek_checkpoint_ignores_its_mtp_layer_and_names_a_missing_latent_projection(tmp_path: Path) -> None:
    """A multi-token-prediction layer after the model's (model.layers.3) is not read; a missing kv_b_proj is named."""
    write_checkpoint(DEEPSEEK, tmp_path, seed=4)
    path = tmp_path / "model.safetensors"
    _rewrite(path, {"model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(128, 32),
                    "model.layers.3.eh_proj.weight": torch.zeros(64, 128)})
    assert load_model(str(tmp_path)).args.num_mtp_layers == 1
    _rewrite(path, {"model.layers.1.self_attn.kv_b_proj.weight": None})
    with pytest.raises(CheckpointError, match="missing 1 tensor.*'model.layers.1.self_attn.kv_b_proj.weight'"):
        load_model(str(tmp_path), packing="plain")


def test_truncated_shard_and_broken_index_are_named(sharded: Path) -> None:
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sharded / sorted(set(index["weight_map"].values()))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name} is not a readable safetensors file"):
        load_model(str(sharded))
    shard.unlink()
    with pytest.raises(CheckpointError, match="names shards that are missing"):
        load_model(str(sharded))
    shard.write_bytes(data)
    index["weight_map"]["model.norm.weight"] = shard.name if index["weight_map"]["model.norm.weight"] != shard.name \
        else sorted(set(index["weight_map"].values()))[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is indexed in"):
        load_model(str(sharded))


def test_checkpoint_headers_are_read_without_the_data(sharded: Path) -> None:
    checkpoint = SafetensorsCheckpoint.open(sharded)
    args = random_preset("tiny")  # another shape: the header check names the first mismatch
    with pytest.raises(CheckpointError):
        checkpoint.check(args)
    assert checkpoint.total_bytes == sum(e.nbytes for entries in checkpoint.shards.values() for e in entries)


def test_a_model_that_does_not_fit_is_refused() -> None:
    # a 2**22 x 2**16 fp32 embedding alone is 1 TiB: more than this machine has free, measured
    args = random_preset("tiny", vocab_size=1 << 22, hidden_size=1 << 16)
    with pytest.raises(ModelDoesNotFit, match=r"huge does not fit: its weights need .* GiB as torch.float32 on cpu"):
        check_fits(args, torch.float32, torch.device("cpu"), "plain", "huge")


def test_fit_check_counts_what_the_model_allocates() -> None:
    args = random_preset("tiny", tie_word_embeddings=True)
    plain = weight_bytes(args, torch.float32, "plain")
    expected = (num_parameters(args) + args.vocab_size * args.hidden_size
                + 2 * args.max_position_embeddings * args.head_dim) * 4
    assert plain == expected
    assert weight_bytes(args, torch.bfloat16, "plain") == plain // 2
    assert weight_bytes(args, torch.float32, "packed") == plain  # the packed copies replace the plain ones
    assert weight_bytes(args, torch.float32, "both") == plain + projection_bytes(args, torch.float32)
    model = LlamaForCausalLM(args)
    assert model.weight_nbytes()["plain"] == plain - 2 * args.max_position_embeddings * args.head_dim * 4
    with pytest.raises(ModelDoesNotFit, match="model.cpu_packed_gemm: false"):
        check_fits(args, torch.float32, torch.device("cpu"), "both", "tiny", available=plain)
    check_fits(args, torch.float32, torch.device("cpu"), "packed", "tiny", available=plain)


def test_fit_check_counts_a_moe_models_experts(tmp_path: Path) -> None:
    write_checkpoint(MOE, tmp_path, seed=4)
    loaded = load_model(str(tmp_path), packing="plain")
    args = loaded.args
    rope = 2 * args.max_position_embeddings * args.head_dim * 4
    assert loaded.model.weight_nbytes()["plain"] == weight_bytes(args, torch.float32, "plain") - rope
    assert num_parameters(args) * 4 == weight_bytes(args, torch.float32, "plain") - rope
    per_expert = 3 * 32 * args.hidden_size
    assert num_parameters(args) - num_active_parameters(args) == 2 * (8 - 2) * per_expert  # 2 sparse layers, top-2


def test_progress_lines_only_when_loading_is_slow(caplog: pytest.LogCaptureFixture) -> None:
    progress = LoadProgress("ckpt", total_bytes=10 << 30, start=100.0, interval_s=5.0)
    assert progress.due_line(1 << 30, now=101.0) is None  # too soon after the start
    line = progress.due_line(1 << 30, now=106.0)
    assert line == "loading ckpt: 2.00 of 10.00 GiB (20%), 0.33 GiB/s"
    assert progress.due_line(1 << 30, now=108.0) is None  # too soon after the last line
    assert progress.due_line(7 << 30, now=200.0) is None  # done: the summary says it
    with caplog.at_level(logging.INFO, logger="mooncaked.model.load_progress"):
        assert progress.finish(now=110.0) == "loaded ckpt: 10.00 GiB of weights in 10.0 s"
    assert "loaded ckpt" in caplog.text


def test_loading_logs_the_checkpoint_and_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_checkpoint(QWEN3, tmp_path, seed=6)
    with caplog.at_level(logging.INFO, logger="mooncaked.model"):
        load_model(str(tmp_path), cpu_packed_gemm=False)
    assert "loading qwen3 checkpoint" in caplog.text and f"loaded {tmp_path}" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_device_without_cuda_is_named() -> None:
    with pytest.raises(ValueError, match="model.device is cuda but this torch sees no CUDA device"):
        load_model("random:tiny", device="cuda")
