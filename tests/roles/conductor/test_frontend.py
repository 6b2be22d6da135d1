"""The sampling controls of an HTTP request reach both instances through the conductor's sampling spec
(roles/conductor/frontend.py), and its stop rules (stop_token_ids, min_tokens) hold (in-process cluster)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from mooncaked.model.loader import load_model
from tests.model.sampling_reference import reference_adjust
from tests.roles.cluster_fixtures import running_roles
from tests.roles.engine_reference import greedy_tokens
from tests.roles.test_conductor_flow import GREEDY, completion, make_config, prompt

NUM_TOKENS = 10


async def test_penalties_bias_stop_token_ids_and_min_tokens_over_http(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    tokens = prompt(11, 40)
    loaded = load_model("random:tiny")
    plain = greedy_tokens(loaded, tokens, NUM_TOKENS)
    stop_id, min_tokens = plain[0], 3  # the plain first token: held back for three tokens, then a stop token

    def penalized(row: list[float], output: list[int]) -> list[float]:
        return reference_adjust(row, prompt=tokens, output=output, logit_bias=[(9, 3.0)], repetition_penalty=1.4,
                                frequency_penalty=0.7, presence_penalty=0.3)

    def held(row: list[float], output: list[int]) -> list[float]:
        return reference_adjust(row, prompt=tokens, output=output, min_tokens=min_tokens, stop_ids=[stop_id])

    expected_penalized = greedy_tokens(loaded, tokens, NUM_TOKENS, adjust=penalized)
    expected_held = greedy_tokens(loaded, tokens, NUM_TOKENS, adjust=held)
    assert expected_penalized != plain and stop_id not in expected_held
    later_stop = plain[4]  # a stop token after min_tokens ends the request there
    assert later_stop not in plain[:4]
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        base = {"prompt": tokens, "max_tokens": NUM_TOKENS, **GREEDY}
        answer = await completion(http, config, {**base, "presence_penalty": 0.3, "frequency_penalty": 0.7,
                                                 "repetition_penalty": 1.4, "logit_bias": {"9": 3.0}})
        assert answer["choices"][0]["text"] == loaded.tokenizer.decode(expected_penalized)
        answer = await completion(http, config, {**base, "stop_token_ids": [stop_id], "min_tokens": min_tokens})
        assert answer["choices"][0]["text"] == loaded.tokenizer.decode(expected_held)
        assert answer["choices"][0]["finish_reason"] == "length"
        answer = await completion(http, config, {**base, "stop_token_ids": [later_stop], "min_tokens": min_tokens})
        assert answer["choices"][0]["text"] == loaded.tokenizer.decode(plain[:4])
        assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 5
