"""GGUF reading: header parsing, name mapping and the Q/K row un-permutation."""

from __future__ import annotations

import numpy as np
import pytest

from mooncaked.model.frontend import embedded_smollm2_path
from mooncaked.model.weights_gguf import GGUFModelFile, hf_tensor_name, unpermute_rope_rows


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to Q/K rows."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(num_heads: int) -> None:
    weight = np.arange(num_heads * 8 * 5, dtype=np.float32).reshape(num_heads * 8, 5)
    assert np.array_equal(unpermute_rope_rows(_llama_cpp_permute(weight, num_heads), num_heads), weight)


def test_tensor_names() -> None:
    assert hf_tensor_name("blk.12.ffn_gate.weight") == "model.layers.12.mlp.gate_proj.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="not part of a llama, qwen2 or qwen3 model"):
        hf_tensor_name("blk.0.ssm_conv.weight")


def test_embedded_header() -> None:
    gguf_file = GGUFModelFile.open(embedded_smollm2_path())
    args = gguf_file.model_args()
    assert (args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads) == (30, 576, 9, 3)
    assert args.tie_word_embeddings and args.rope_theta == 100000.0
    assert len(gguf_file.metadata["tokenizer.ggml.tokens"]) == 49152
    by_name = {t.name: t for t in gguf_file.tensors}
    assert by_name["blk.0.attn_k.weight"].shape == (192, 576)


def test_not_a_gguf_file(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "x.gguf"
    path.write_bytes(b"nope" * 10)
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFModelFile.open(path)
