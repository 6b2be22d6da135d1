"""A Qwen3-MoE checkpoint written by transformers served by a whole in-process cluster (store, prefill, decode,
conductor): greedy completions equal transformers', and a second request of the same several-block prompt reuses
the first one's KV from the store."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import pytest
import torch

from mooncaked.model.loader import load_model
from tests.model.family_checkpoints import CASES, write_checkpoint
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_conductor_flow import GREEDY, completion

pytest.importorskip("transformers")

MOE = next(c for c in CASES if c.model_type == "qwen3_moe")
NEW_TOKENS = 8


def _transformers_greedy(hf: torch.nn.Module, tokens: list[int], num_tokens: int) -> list[int]:
    """Argmax after argmax, EOS included (the requests ignore EOS)."""
    out = list(tokens)
    with torch.no_grad():
        for _ in range(num_tokens):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens):]


async def test_qwen3_moe_served_equals_transformers_and_reuses_its_prefix(tmp_path: Path) -> None:
    checkpoint = tmp_path / "qwen3-moe"
    hf = write_checkpoint(MOE, checkpoint, seed=13)
    rng = random.Random(5)
    tokens = [rng.randrange(3, 300) for _ in range(70)]  # 4 full blocks of 16 and a tail
    text = load_model(str(checkpoint)).tokenizer.decode(_transformers_greedy(hf, tokens, NEW_TOKENS))
    config = cluster_config(
        tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode"),
                   instance("c0", "conductor")],
        model={"source": str(checkpoint), "name": "qwen3-moe-tiny", "max_model_len": 512,
               "weight_cache_dir": str(tmp_path / "weights")},
        worker={"inline_prefill_max_tokens": 0})
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        first = await completion(http, config, {"prompt": tokens, "max_tokens": NEW_TOKENS, **GREEDY})
        assert first["choices"][0]["text"] == text
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = await completion(http, config, {"prompt": tokens, "max_tokens": NEW_TOKENS, **GREEDY})
        assert again["choices"][0]["text"] == text
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert list((tmp_path / "weights").glob("*.weights"))  # the experts were served from the host's weight file
