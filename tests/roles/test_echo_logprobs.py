"""Echo and prompt logprobs through a whole in-process cluster, against transformers on the same checkpoint (a tiny
random Llama 3.1 written by transformers): the scores an evaluation harness computes from `echo` + `logprobs` with
`max_tokens: 0` (several prompts in one request, as lm-evaluation-harness sends them) equal transformers'
log-likelihoods within 1e-3, for prompts longer than a prefill chunk and for prompts already in the cache."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from tests.model.family_checkpoints import CASES, write_checkpoint
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles

CONTEXT = [random.Random(1).randrange(3, 250) for _ in range(90)]  # more than a prefill chunk (64)
CHOICES = [[random.Random(seed).randrange(3, 250) for _ in range(length)] for seed, length in ((2, 3), (3, 5), (4, 1))]


class Live:
    def __init__(self, url: str, http: aiohttp.ClientSession, model: Any) -> None:
        self.url, self.http, self.model = url, http, model

    async def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(f"{self.url}{route}", json={"temperature": 0.0, **body}) as response:
            data: dict[str, Any] = await response.json()
            assert response.status == 200, data
            return data

    def log_likelihoods(self, tokens: list[int]) -> list[float]:
        """transformers: log p(token i | tokens before it), i >= 1."""
        with torch.no_grad():
            logits = self.model(torch.tensor([tokens])).logits[0].float()
        return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1))[:, 0].tolist()


@pytest.fixture(params=["disaggregated", "colocated"])
async def live(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Live]:
    """A prefill instance computes the prompt logprobs, or (colocated: no prefill instance) the decode instance's
    inline prefill does."""
    checkpoint = tmp_path / "llama"
    model = write_checkpoint(next(c for c in CASES if c.case_id == "llama3.1-untied-rope-llama3"), checkpoint)
    names = ["s0", "p0", "d0", "c0"] if request.param == "disaggregated" else ["s0", "d0", "c0"]
    roles = {"s0": "store", "p0": "prefill", "d0": "decode", "c0": "conductor"}
    config = cluster_config(tmp_path, [instance(name, roles[name]) for name in names],
                            model={"source": str(checkpoint), "name": "llama", "max_model_len": 512},
                            worker={"inline_prefill_max_tokens": 0, "profile_s": 0})
    async with running_roles(config, names), aiohttp.ClientSession() as http:
        yield Live(f"http://127.0.0.1:{config.instance_named('c0').port}", http, model)


async def test_scores_of_choices_equal_transformers(live: Live) -> None:
    prompts = [CONTEXT + choice for choice in CHOICES]
    for attempt in range(2):  # the second time every block of the context is cached: every row is computed anyway
        answer = await live.post("/v1/completions", {"prompt": prompts, "max_tokens": 0, "echo": True,
                                                     "logprobs": 1})
        assert [c["index"] for c in answer["choices"]] == list(range(len(prompts)))
        assert answer["usage"]["completion_tokens"] == 0
        assert answer["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
        for choice, prompt, continuation in zip(answer["choices"], prompts, CHOICES):
            logprobs = choice["logprobs"]
            assert choice["finish_reason"] == "length" and len(logprobs["tokens"]) == len(prompt)
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            expected = live.log_likelihoods(prompt)
            assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-3)
            score = sum(logprobs["token_logprobs"][-len(continuation):])
            assert score == pytest.approx(sum(expected[-len(continuation):]), abs=1e-3), attempt


async def test_vllm_prompt_logprobs_and_echo_with_generation(live: Live) -> None:
    prompt = CONTEXT[:20]
    answer = await live.post("/v1/completions", {"prompt": prompt, "max_tokens": 3, "prompt_logprobs": 2,
                                                 "echo": True})
    choice = answer["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    expected = live.log_likelihoods(prompt)
    for token_id, entry, logprob in zip(prompt[1:], entries[1:], expected):
        assert entry[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-3)
        ranks = sorted(item["rank"] for item in entry.values())
        assert 1 in ranks and len(entry) in (2, 3)
    assert answer["usage"]["completion_tokens"] == 3 and len(choice["text"]) > 0
    chat = await live.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
