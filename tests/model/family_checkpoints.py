"""Tiny random checkpoints of every supported family, written by transformers (and GGUF files written the way
llama.cpp's converter lays them out), with a byte-level tokenizer and a family-style chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mooncaked.model.tokenizer import TEST_SPECIAL_TOKENS, byte_level_test_tokenizer

# Chat templates written in each family's style (their features, not their text): a default system prompt
# and tools (Qwen), an optional thinking switch (Qwen3), header blocks with a date (Llama 3), alternation
# enforced with raise_exception and a <<SYS>> block (Llama 2 / Mistral).
CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message['role'] == 'system') %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

HEADER_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}\
{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ date_string | default('26 Jul 2024') }}

{{ system }}<|eot_id|>
{%- for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

INST_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}\
{%- set messages = messages[1:] %}{%- else %}{%- set system = none %}{%- endif %}
{%- for message in messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}
{%- if loop.first and system %}{%- set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}\
{%- else %}{%- set content = message['content'] %}{%- endif %}
{%- if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}
{%- else %}{{ ' ' + content | trim + ' ' + eos_token }}{%- endif %}
{%- endfor %}"""


@dataclass(frozen=True)
class FamilyCase:
    """One tiny checkpoint: a transformers config and the template, stored in chat_template.jinja or (as
    transformers 4 did) inline in tokenizer_config.json."""

    case_id: str
    model_type: str
    config: dict[str, Any]
    chat_template: str
    template_in_tokenizer_config: bool = False
    extra_template_kwargs: dict[str, Any] = field(default_factory=dict)


_BASE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
         "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-6}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 500000.0}

# 8 experts of 32 columns, top-2 renormalized, on layers 0 and 2 (layer 1 is dense: mlp_only_layers)
QWEN3_MOE = {"head_dim": 16, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}

# Multi-head Latent Attention with a query bottleneck, YaRN (mscale != mscale_all_dim: both scales matter), a dense
# first layer, then 8 experts in 4 groups (2 groups and 2 experts a token), one shared expert, a correction bias
DEEPSEEK_V3 = {"num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
               "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "n_group": 4,
               "topk_group": 2, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
               "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
               "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                   "mscale": 0.9, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                   "rope_theta": 10000.0}}

CASES = [
    FamilyCase("llama2-mha", "llama", {**_BASE, "num_key_value_heads": 4}, INST_TEMPLATE,
               template_in_tokenizer_config=True),
    FamilyCase("llama3.1-untied-rope-llama3", "llama", {**_BASE, "rope_parameters": _LLAMA3_ROPE}, HEADER_TEMPLATE),
    FamilyCase("llama3.2-tied", "llama", {**_BASE, "tie_word_embeddings": True, "rope_parameters": _LLAMA3_ROPE},
               HEADER_TEMPLATE),
    FamilyCase("llama-attention-and-mlp-bias", "llama", {**_BASE, "attention_bias": True, "mlp_bias": True},
               HEADER_TEMPLATE),
    FamilyCase("mistral-sliding-window", "mistral", {**_BASE, "sliding_window": 8, "num_key_value_heads": 1},
               INST_TEMPLATE),
    FamilyCase("qwen2.5-qkv-bias-tied", "qwen2", {**_BASE, "tie_word_embeddings": True, "rope_theta": 1e6},
               CHATML_TOOLS_TEMPLATE),
    FamilyCase("qwen2-windowed-layers", "qwen2", {**_BASE, "use_sliding_window": True, "sliding_window": 8,
                                                  "max_window_layers": 1}, CHATML_TOOLS_TEMPLATE,
               template_in_tokenizer_config=True),
    FamilyCase("qwen3-qk-norm-tied", "qwen3", {**_BASE, "head_dim": 32, "tie_word_embeddings": True},
               CHATML_TOOLS_TEMPLATE, extra_template_kwargs={"enable_thinking": False}),
    FamilyCase("qwen2.5-yarn-long-context", "qwen2", {**_BASE, "max_position_embeddings": 128, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1e6}},
               CHATML_TOOLS_TEMPLATE),
    FamilyCase("qwen3-moe-mlp-only-layer", "qwen3_moe", {**_BASE, **QWEN3_MOE}, CHATML_TOOLS_TEMPLATE,
               extra_template_kwargs={"enable_thinking": False}),
    FamilyCase("deepseek-v3-mla-yarn-grouped-experts", "deepseek_v3", {**_BASE, **DEEPSEEK_V3}, HEADER_TEMPLATE),
]
CASE_IDS = [c.case_id for c in CASES]


def hf_config(case: FamilyCase) -> Any:
    import transformers

    config = transformers.AutoConfig.for_model(case.model_type, **case.config)
    config._attn_implementation = "eager"
    return config


def random_hf_model(case: FamilyCase, seed: int) -> Any:
    """A transformers model of `case` with every parameter random (norms near 1, biases non-zero; a router's
    score correction bias too, a buffer)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config(case)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise * (0.1 if name.endswith("bias") else 0.05))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)
    return model


def write_tokenizer(case: FamilyCase, path: Path) -> None:
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_test_tokenizer().backend, bos_token=TEST_SPECIAL_TOKENS[1],
        eos_token=TEST_SPECIAL_TOKENS[2])
    tokenizer.chat_template = case.chat_template
    tokenizer.save_pretrained(path)
    if case.template_in_tokenizer_config:
        (path / "chat_template.jinja").unlink()
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = case.chat_template
        config_path.write_text(json.dumps(config))


def write_checkpoint(case: FamilyCase, path: Path, seed: int = 0, max_shard_size: str | None = None) -> Any:
    """Save a random model of `case` and its tokenizer under `path`; returns the transformers model."""
    model = random_hf_model(case, seed)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    write_tokenizer(case, path)
    return model


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The Q/K row order convert_hf_to_gguf.py writes for the `llama` architecture."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(model: Any, path: Path, arch: str, rope_freqs: np.ndarray | None = None,
               chat_template: str | None = None,
               sentencepiece: tuple[list[str], list[float], list[int]] | None = None, is_q8_0: bool = False) -> None:
    """A GGUF file of a transformers model, laid out as llama.cpp's converter does for `arch` (fp32 tensors; with
    `is_q8_0` every matrix whose rows are whole Q8_0 blocks quantized), with the byte-level test vocabulary or a
    SentencePiece one (tokens, scores, token types)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if sentencepiece is None:
        _add_tokenizer(writer, config.vocab_size)
    else:
        add_sentencepiece_vocabulary(writer, *sentencepiece)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        q8_0 = gguf.GGMLQuantizationType.Q8_0
        if is_q8_0 and data.ndim == 2 and data.shape[1] % gguf.GGML_QUANT_SIZES[q8_0][0] == 0:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: Any, vocab_size: int) -> None:
    """The byte-level test tokenizer as a gpt2-style GGUF vocabulary (specials are control tokens), padded to the
    embedding's rows with unused tokens as the converter does."""
    vocab = byte_level_test_tokenizer().backend.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    num_real = len(tokens)
    tokens += [f"[PAD{i}]" for i in range(num_real, vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in TEST_SPECIAL_TOKENS else 1 if i < num_real else 5 for i, t in enumerate(tokens)])
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def add_sentencepiece_vocabulary(writer: Any, tokens: list[str], scores: list[float], types: list[int]) -> None:
    """A llama-style (SentencePiece) GGUF vocabulary: <unk>, <s>, </s> at 0, 1, 2; BOS added, as Llama 2 files."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
