"""Hugging Face checkpoint directories: `config.json` plus one or many `*.safetensors`.

1. `read_hf_config(dir)` parses `config.json` into ModelArgs (only Llama architectures are accepted).
2. `iter_safetensors_files(dir)` lists shards: from `model.safetensors.index.json` when present, else every
   `*.safetensors` in the directory.
3. `load_hf_state_dict(dir)` reads all shards into one name -> tensor dict (memory-mapped by safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mooncaked.model.config import ModelArgs

_LLAMA_MODEL_TYPES = {"llama", "mistral"}


def read_hf_config(model_dir: Path) -> ModelArgs:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; a Hugging Face checkpoint directory needs one")
    config: dict[str, Any] = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type not in _LLAMA_MODEL_TYPES:
        raise ValueError(f"{config_path}: model_type {model_type!r} is not supported; only Llama-family models")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{config_path}: attention_bias / mlp_bias are not supported")
    return ModelArgs.from_hf_config(config)


def iter_safetensors_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    return files


def load_hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in iter_safetensors_files(model_dir):
        state.update(load_file(str(path), device="cpu"))
    return state
