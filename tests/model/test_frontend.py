"""load_frontend gives the model's tokenizer, template, EOS ids and shape without its weights."""

from __future__ import annotations

import pytest

from mooncaked.model.frontend import load_frontend
from mooncaked.model.loader import load_model
from mooncaked.model.presets import random_preset
from mooncaked.model.weight_names import num_parameters
from mooncaked.model.weight_names import random_hf_state_dict


@pytest.mark.parametrize("source", ["random:tiny", "embedded:smollm2"])
def test_frontend_matches_the_loaded_model(source: str) -> None:
    frontend = load_frontend(source)
    if source.startswith("random:"):
        loaded = load_model(source)
        assert frontend.eos_token_ids == loaded.eos_token_ids and frontend.args == loaded.args
        assert frontend.model_id == loaded.model_id
    messages = [{"role": "user", "content": "What is the capital of France? Ünïcödé"}]
    text = frontend.chat_template.render(messages)
    assert frontend.tokenizer.decode(frontend.tokenizer.encode(text, add_special_tokens=False),
                                     skip_special_tokens=False) == text
    if source == "embedded:smollm2":
        assert frontend.model_id == "smollm2-135m" and frontend.args.num_layers == 30
        assert "<|im_start|>user" in text


@pytest.mark.parametrize("tied", [True, False])
def test_num_parameters_counts_every_weight(tied: bool) -> None:
    args = random_preset("tiny", tie_word_embeddings=tied)
    state = random_hf_state_dict(args, 0)
    assert num_parameters(args) == sum(t.numel() for t in state.values())


def test_unknown_source() -> None:
    with pytest.raises(ValueError, match="is not 'embedded:smollm2'"):
        load_frontend("/nonexistent/model")
