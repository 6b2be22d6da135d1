"""A thinking model through a whole in-process cluster: a tiny random Qwen3 checkpoint whose tokenizer holds
`<think>` and `</think>` as tokens and whose template opens the block (or, with chat_template_kwargs
enable_thinking false, writes it empty). Its reasoning comes back in reasoning_content, never in content, plain
and streamed, and a JSON constraint shapes the answer only."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.model.family_checkpoints import CASES, write_checkpoint
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles

THINKING_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


class Live:
    def __init__(self, url: str, http: aiohttp.ClientSession, think_ids: tuple[int, int]) -> None:
        self.url, self.http, self.think_ids = url, http, think_ids

    async def chat(self, **extra: Any) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": "Is it sunny?"}], "max_tokens": 60, "temperature": 1.0,
                "seed": 5, "logit_bias": {str(self.think_ids[1]): 3.0}, **extra}
        async with self.http.post(f"{self.url}/v1/chat/completions", json=body) as response:
            if not body.get("stream"):
                data: dict[str, Any] = await response.json()
                assert response.status == 200, data
                return dict(data["choices"][0]["message"])
            reasoning, content = [], []
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
                    reasoning.append(delta.get("reasoning_content") or "")
                    content.append(delta.get("content") or "")
            return {"reasoning_content": "".join(reasoning) or None, "content": "".join(content)}


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    import transformers

    checkpoint = tmp_path / "qwen3"
    case = next(c for c in CASES if c.model_type == "qwen3")
    write_checkpoint(dataclasses.replace(case, chat_template=THINKING_TEMPLATE), checkpoint)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.add_tokens(["<think>", "</think>"])  # as Qwen3's vocabulary holds them: one token each
    tokenizer.save_pretrained(checkpoint)
    think_ids = (tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>"))
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode"),
                                       instance("c0", "conductor")],
                            model={"source": str(checkpoint), "name": "qwen3-tiny", "max_model_len": 512},
                            worker={"inline_prefill_max_tokens": 0, "profile_s": 0})
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        yield Live(f"http://127.0.0.1:{config.instance_named('c0').port}", http, think_ids)


async def test_reasoning_comes_apart_from_the_answer_plain_and_streamed(live: Live) -> None:
    plain = await live.chat()
    assert plain["reasoning_content"] and plain["content"]  # the block closed within max_tokens
    assert "</think>" not in plain["reasoning_content"]  # it ends at the first close (the answer may say anything)
    streamed = await live.chat(stream=True)
    assert (streamed["reasoning_content"], streamed["content"]) == (plain["reasoning_content"], plain["content"] or "")


async def test_a_json_constraint_shapes_the_answer_not_the_reasoning(live: Live) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}
    reasonings = []
    for seed in (1, 2, 3):
        message = await live.chat(response_format=format_, seed=seed, max_tokens=200)
        assert isinstance(json.loads(message["content"])["ok"], bool)
        reasonings.append(message.get("reasoning_content"))
    assert any(reasonings)  # free text before the answer (a model may also close its block at once)


async def test_thinking_switched_off_through_the_template(live: Live) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}
    message = await live.chat(response_format=format_, chat_template_kwargs={"enable_thinking": False})
    assert message.get("reasoning_content") is None
    assert isinstance(json.loads(message["content"])["ok"], bool)
