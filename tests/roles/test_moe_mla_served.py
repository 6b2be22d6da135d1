"""Qwen3-MoE and DeepSeek-V3 (MLA) checkpoints written by transformers, served by a whole in-process cluster (store,
prefill, decode, conductor): greedy completions equal transformers', and a second request of the same several-block
prompt reuses the first one's KV from the store; an MLA model's store objects hold only its latents."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import pytest
import torch

from mooncaked.model.loader import load_model
from tests.model.family_checkpoints import CASES, FamilyCase, write_checkpoint
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_conductor_flow import GREEDY, completion

pytest.importorskip("transformers")

SERVED = [c for c in CASES if c.model_type in ("qwen3_moe", "deepseek_v3")]
NEW_TOKENS = 8


def _transformers_greedy(hf: torch.nn.Module, tokens: list[int], num_tokens: int) -> list[int]:
    """Argmax after argmax, EOS included (the requests ignore EOS)."""
    out = list(tokens)
    with torch.no_grad():
        for _ in range(num_tokens):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens):]


@pytest.mark.parametrize("case", SERVED, ids=[c.case_id for c in SERVED])
async def test_served_equals_transformers_and_reuses_its_prefix(case: FamilyCase, tmp_path: Path) -> None:
    checkpoint = tmp_path / case.case_id
    hf = write_checkpoint(case, checkpoint, seed=13)
    rng = random.Random(5)
    tokens = [rng.randrange(3, 300) for _ in range(70)]  # 4 full blocks of 16 and a tail
    text = load_model(str(checkpoint)).tokenizer.decode(_transformers_greedy(hf, tokens, NEW_TOKENS))
    config = cluster_config(
        tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode"),
                   instance("c0", "conductor")],
        model={"source": str(checkpoint), "name": case.case_id, "max_model_len": 512,
               "weight_cache_dir": str(tmp_path / "weights")},
        worker={"inline_prefill_max_tokens": 0})
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        args = hf.config
        if case.model_type == "deepseek_v3":  # an object: every layer's latent and rope key of 16 tokens, fp32
            object_bytes = args.num_hidden_layers * 16 * (args.kv_lora_rank + args.qk_rope_head_dim) * 4
            assert roles["p0"].worker.block_nbytes == roles["d0"].worker.block_nbytes == object_bytes  # type: ignore
        first = await completion(http, config, {"prompt": tokens, "max_tokens": NEW_TOKENS, **GREEDY})
        assert first["choices"][0]["text"] == text
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = await completion(http, config, {"prompt": tokens, "max_tokens": NEW_TOKENS, **GREEDY})
        assert again["choices"][0]["text"] == text
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert list((tmp_path / "weights").glob("*.weights"))  # the weights were served from the host's weight file
