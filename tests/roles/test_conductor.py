"""The conductor without workers: request preparation (limits, keys) and its HTTP surface when nothing is up."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from mooncaked.api.errors import ApiError
from mooncaked.api.requests import parse_chat_request, parse_completion_request
from mooncaked.config import Config
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.metrics import Metrics
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.cluster_view import ClusterView, LivePredictors
from mooncaked.roles.conductor import ConductorRole, default_predictors, model_frontend, policy_config
from mooncaked.roles.conductor_backend import ConductorBackend
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles


def make_config(tmp_path: Path, **sections: dict[str, object]) -> Config:
    return cluster_config(tmp_path, [instance("s0", "store"), instance("d0", "decode"), instance("c0", "conductor")],
                          rpc={"connect_timeout_s": 0.3}, **sections)


def make_backend(config: Config) -> ConductorBackend:
    loaded = load_model(config.model.source, dtype=config.model.dtype, seed=config.model.seed)
    peers = PeerClients(config, config.instance_named("c0"))
    view = ClusterView(config, peers, policy_config(config), LivePredictors(default_predictors(config, loaded)))
    return ConductorBackend(config, model_frontend(config, loaded), view, peers, Metrics())


async def test_prepare_tokenizes_resolves_max_tokens_and_keys(tmp_path: Path) -> None:
    config = make_config(tmp_path, conductor={"default_max_tokens": 7})
    backend = make_backend(config)
    ids = list(range(3, 3 + 40))
    prepared = await backend.prepare(parse_completion_request({"prompt": ids, "max_tokens": 5}, request_id="a",
                                                              model_ids=backend.model_ids()))
    namespace = model_namespace(load_model("random:tiny").model_id, config.model.dtype, config.kv.block_size)
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
])
async def test_prepare_rejects_what_cannot_run(tmp_path: Path, body: dict[str, object], status: int,
                                               param: str) -> None:
    backend = make_backend(make_config(tmp_path))
    with pytest.raises(ApiError) as raised:
        await backend.prepare(parse_completion_request(body, request_id="x", model_ids=backend.model_ids()))
    assert raised.value.status == status and raised.value.param == param


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
