"""The conductor without workers: request preparation, its HTTP surface when nothing is up, config wiring."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from mooncaked.api.errors import ApiError
from mooncaked.api.requests import parse_chat_request, parse_completion_request
from mooncaked.config import Config, ConfigError
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.backend import ConductorBackend
from mooncaked.roles.conductor.frontend import prompt_token_ids
from mooncaked.roles.conductor.leg import Leg, LegWork
from mooncaked.roles.conductor.leg_failures import MIGRATION_CAUSES, LegFailed
from mooncaked.roles.conductor.role import (ConductorRole, default_predictors, model_frontend, policy_config,
                                            view_settings)
from mooncaked.roles.conductor.view.cluster import ClusterView
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.roles.worker.messages import SamplingSpec
from mooncaked.rpc import ResourceExhausted
from mooncaked.runtime.metrics import Metrics
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles


def make_config(tmp_path: Path, **sections: dict[str, object]) -> Config:
    return cluster_config(tmp_path, [instance("s0", "store"), instance("d0", "decode"), instance("c0", "conductor")],
                          rpc={"connect_timeout_s": 0.3}, **sections)


def make_backend(config: Config) -> ConductorBackend:
    loaded = load_model(config.model.source, dtype=config.model.dtype, seed=config.model.seed)
    peers = PeerClients(config, config.instance_named("c0"))
    view = ClusterView(config, peers, policy_config(config), LivePredictors(default_predictors(config, loaded)),
                       view_settings(config))
    return ConductorBackend(config, model_frontend(config, loaded), view, peers, Metrics())


async def test_prepare_tokenizes_resolves_max_tokens_and_keys(tmp_path: Path) -> None:
    config = make_config(tmp_path, conductor={"default_max_tokens": 7})
    backend = make_backend(config)
    ids = list(range(3, 3 + 40))
    prepared = await backend.prepare(parse_completion_request({"prompt": ids, "max_tokens": 5}, request_id="a",
                                                              model_ids=backend.model_ids()))
    tiny = load_model("random:tiny")
    namespace = model_namespace(tiny.model_id, config.model.dtype, config.kv.block_size, tiny.args.kv_geometry)
    assert prepared.prompt_token_ids == tuple(ids) and prepared.max_tokens == 5
    assert prepared.block_keys == tuple(block_keys(ids, 16, namespace)) and len(prepared.block_keys) == 2
    chat = await backend.prepare(parse_chat_request({"messages": [{"role": "user", "content": "hi"}]},
                                                    request_id="b", model_ids=backend.model_ids()))
    text = backend.model.chat_template.render([{"role": "user", "content": "hi"}])
    assert list(chat.prompt_token_ids) == backend.model.tokenizer.encode(text, add_special_tokens=False)
    assert chat.max_tokens == 7  # no max_tokens on a chat: conductor.default_max_tokens, within the context


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": [5] * 1024}, 413, "prompt"),  # prompt + 1 token > model.max_model_len 1024
    ({"prompt": [5] * 1000, "max_tokens": 30}, 400, "max_tokens"),
    ({"prompt": [5, 400]}, 400, "prompt"),  # the tiny model's vocabulary has 320 tokens
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [5], "logit_bias": {"320": 1}}, 400, "logit_bias"),
    ({"prompt": [5], "stop_token_ids": [3, 320]}, 400, "stop_token_ids"),
])
async def test_prepare_rejects_what_cannot_run(tmp_path: Path, body: dict[str, object], status: int,
                                               param: str) -> None:
    backend = make_backend(make_config(tmp_path))
    with pytest.raises(ApiError) as raised:
        await backend.prepare(parse_completion_request(body, request_id="x", model_ids=backend.model_ids()))
    assert raised.value.status == status and raised.value.param == param



async def test_min_tokens_beyond_the_default_max_tokens_is_a_400_naming_it(tmp_path: Path) -> None:
    backend = make_backend(make_config(tmp_path, conductor={"default_max_tokens": 7}))
    body = {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 8}
    with pytest.raises(ApiError) as raised:
        await backend.prepare(parse_chat_request(body, request_id="x", model_ids=backend.model_ids()))
    assert raised.value.status == 400 and raised.value.param == "min_tokens"


async def test_prompt_token_ids_of_a_generation_and_of_a_context_differ_by_the_generation_prompt(
        tmp_path: Path) -> None:
    model = make_backend(make_config(tmp_path)).model
    messages = [{"role": "user", "content": "hi"}]
    chat = parse_chat_request({"messages": messages}, request_id="c", model_ids=list(model.served_names))
    for add_generation_prompt in (True, False):
        text = model.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        assert await prompt_token_ids(model, chat, add_generation_prompt=add_generation_prompt) == \
            model.tokenizer.encode(text, add_special_tokens=False)
    completion = parse_completion_request({"prompt": "hi"}, request_id="p", model_ids=list(model.served_names))
    assert await prompt_token_ids(model, completion, add_generation_prompt=True) == model.tokenizer.encode("hi")


@pytest.mark.parametrize("field", ["prompt", "messages"])
async def test_text_far_beyond_the_context_is_refused_without_tokenizing_it(tmp_path: Path, field: str) -> None:
    backend = make_backend(make_config(tmp_path))
    text = "many words " * 200_000  # 2.2 M characters; the context holds 1024 tokens of at most a few characters
    body: dict[str, object] = {"prompt": text} if field == "prompt" else {
        "messages": [{"role": "user", "content": text}]}
    parse = parse_completion_request if field == "prompt" else parse_chat_request
    started = time.monotonic()
    with pytest.raises(ApiError) as refused:
        await backend.prepare(parse(body, request_id="long", model_ids=backend.model_ids()))
    assert time.monotonic() - started < 0.5, "refused before tokenizing"
    assert refused.value.status == 413 and refused.value.param == field
    assert "2200000 characters: far more than this model's maximum context length of 1024 tokens" in \
        refused.value.message


async def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(tmp_path: Path) -> None:
    backend = make_backend(make_config(tmp_path, model={"max_model_len": 4096}))
    text = "hello world, " * 8_000  # within what 4096 tokens may hold, so it is tokenized (then too long: 413)
    request = parse_completion_request({"prompt": text}, request_id="t", model_ids=backend.model_ids())
    preparing = asyncio.ensure_future(backend.prepare(request))
    num_ticks = 0
    while not preparing.done():
        await asyncio.sleep(0.001)
        num_ticks += 1
    with pytest.raises(ApiError, match="tokens"):
        preparing.result()
    assert num_ticks >= 3, "the event loop ran while the prompt was tokenized"

async def test_http_surface_with_no_worker_up(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# keys\nsecret-1\n")
    config = make_config(tmp_path, conductor={"api_keys_file": str(keys_file)})
    url = f"http://127.0.0.1:{config.instance_named('c0').port}"
    auth = {"Authorization": "Bearer secret-1"}
    async with running_roles(config, ["s0", "c0"]) as roles, aiohttp.ClientSession() as http:
        assert isinstance(roles["c0"], ConductorRole)
        async with http.get(f"{url}/health") as response:
            assert response.status == 503 and (await response.json())["instances_up"] == {"prefill": 0, "decode": 0}
        async with http.post(f"{url}/v1/completions", json={"prompt": "hi"}) as response:
            assert response.status == 401
        async with http.get(f"{url}/v1/models", headers=auth) as response:
            assert [m["id"] for m in (await response.json())["data"]] == ["tiny", "random-tiny"]
        async with http.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=auth) as response:
            body = await response.json()
            assert response.status == 503 and "No decode instance is up" in body["error"]["message"]
        async with http.post(f"{url}/v1/completions", json={"prompt": [5] * 2000}, headers=auth) as response:
            assert response.status == 413
        async with http.get(f"{url}/v1/cluster", headers=auth) as response:
            cluster = await response.json()
        assert [(i["name"], i["is_up"]) for i in cluster["instances"]] == [("d0", False)]
        assert cluster["stores"][0]["is_up"] and cluster["index"]["num_keys"] == 0
        async with http.get(f"{url}/metrics") as response:
            text = await response.text()
        assert 'mooncaked_rejections_total{reason="no_decode_instance"} 1.0' in text


def write_profile(path: Path, seconds_per_token: float) -> Path:
    samples = [[n, p, seconds_per_token * (n - p)] for n in (100, 200, 400, 800) for p in (0, n // 2)]
    path.write_text(json.dumps({"prefill": samples, "decode": [[1, 100, 0.01], [2, 200, 0.02], [4, 400, 0.04]]}))
    return path


def test_scheduler_and_conductor_options_reach_the_predictors_policy_and_view(tmp_path: Path) -> None:
    loaded = load_model("random:tiny")
    base = default_predictors(make_config(tmp_path), loaded)
    faster = default_predictors(make_config(tmp_path, scheduler={"device_flops": 1e13, "link_gbps": 8.0,
                                                                  "device_memory_bandwidth": 2e11}), loaded)
    assert faster.prefill.predict(1000, 0) == pytest.approx(base.prefill.predict(1000, 0) / 100)  # cpu: 1e11
    assert faster.decode.predict(1, 0) == pytest.approx(base.decode.predict(1, 0) / 10)  # cpu: 2e10
    assert faster.transfer.bandwidth == 1e9
    profiled = default_predictors(make_config(tmp_path, scheduler={
        "prefill_profile": str(write_profile(tmp_path / "profile.json", 0.01))}), loaded)
    assert profiled.prefill.predict(300, 100) == pytest.approx(2.0, rel=1e-3)
    assert profiled.decode.predict(3, 300) == pytest.approx(0.03, rel=1e-3)
    config = make_config(tmp_path, scheduler={"decode_time_s": 7.5}, conductor={
        "load_poll_interval_s": 0.3, "load_poll_timeout_s": 0.7, "startup_sync_timeout_s": 2.0,
        "events_renew_s": 9.0})
    assert policy_config(config).decode_time_s == 7.5
    settings = view_settings(config)
    assert (settings.poll_interval_s, settings.poll_timeout_s, settings.startup_timeout_s) == (0.3, 0.7, 2.0)
    assert settings.follower.events_renew_s == 9.0


@pytest.mark.parametrize(("content", "problem"), [
    (None, "No such file"),
    ("{not json", "Expecting property name"),
    ('[[100, 0, 1.0]]', "top level must be an object"),
    ('{"prefil": [[100, 0, 1.0]]}', "top level must be an object"),
    ('{"prefill": [[100, 0, 1.0]]}', "need at least 6 prefill samples"),
    ('{"decode": [[1, 2], [3, 4], [5, 6]]}', "not enough values"),
])
def test_a_bad_prefill_profile_fails_start_up_naming_the_file(tmp_path: Path, content: str | None,
                                                              problem: str) -> None:
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    config = make_config(tmp_path, scheduler={"prefill_profile": str(path)})
    with pytest.raises(ConfigError, match="scheduler.prefill_profile") as raised:
        default_predictors(config, load_model("random:tiny"))
    assert str(path) in str(raised.value) and problem in str(raised.value)


async def test_a_decode_instance_without_pages_in_time_makes_the_leg_move(tmp_path: Path) -> None:
    """pages_not_freed (a wrong memory forecast) is a migration to another decode instance, not an error and not
    a failure of the instance; a decode instance's other refusals stay 429s."""
    config = make_config(tmp_path)
    backend = make_backend(config)
    try:
        work = LegWork("r", (1, 2, 3), (), SamplingSpec(max_tokens=4), 0.0, 4, "")
        leg = Leg(config, backend.view, backend.peers, work)
        moved = leg._failure("decode", "d0", ResourceExhausted("pages_not_freed: 9 KV pages were not freed"))
        assert isinstance(moved, LegFailed) and moved.cause == "decode_pages" and moved.cause in MIGRATION_CAUSES
        assert backend.view.decode["d0"].last_error == ""  # not reported down
        refused = leg._failure("decode", "d0", ResourceExhausted("memory: needs 9 KV pages, 0 free"))
        assert isinstance(refused, ApiError) and refused.status == 429
    finally:
        await backend.peers.close()
