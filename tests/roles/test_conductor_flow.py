"""Requests through a whole in-process cluster (store, prefill, decode, conductor; tiny random model, loopback)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.api.requests import parse_completion_request
from mooncaked.config import Config
from mooncaked.model.loader import load_model
from mooncaked.roles import make_role
from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.store import StoreRole
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.prefill import forward as prefill_forward
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.engine_reference import greedy_tokens

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def make_config(tmp_path: Path, *, with_prefill: bool = True, **sections: dict[str, Any]) -> Config:
    workers = [instance("p0", "prefill")] if with_prefill else []
    worker = {"inline_prefill_max_tokens": 0, **sections.pop("worker", {})}
    return cluster_config(tmp_path, [instance("s0", "store"), *workers, instance("d0", "decode"),
                                     instance("c0", "conductor")], worker=worker, **sections)


def url(config: Config, path: str) -> str:
    return f"http://127.0.0.1:{config.instance_named('c0').port}{path}"


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(num_tokens)]


def expected_text(tokens: list[int], num_tokens: int) -> tuple[list[int], str]:
    loaded = load_model("random:tiny")
    ids = greedy_tokens(loaded, tokens, num_tokens)
    return ids, loaded.tokenizer.decode(ids)


async def sse_events(response: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def completion(http: aiohttp.ClientSession, config: Config, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url(config, "/v1/completions"), json=body) as response:
        data: dict[str, Any] = await response.json()
        assert response.status == 200, data
        return data


async def test_completions_chat_stop_strings_and_prefix_reuse(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    tokens = prompt(1, 70)  # 4 full blocks of 16 and a tail
    _, text = expected_text(tokens, 8)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        whole = await completion(http, config, {"prompt": tokens, "max_tokens": 8, **GREEDY})
        assert whole["choices"][0]["text"] == text and whole["choices"][0]["finish_reason"] == "length"
        assert whole["usage"]["completion_tokens"] == 8
        body = {"prompt": tokens, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                **GREEDY}
        async with http.post(url(config, "/v1/completions"), json=body) as response:
            events = await sse_events(response)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == text
        # the second request shares the prompt: every full block but the one holding the last token is reused
        assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        stop = next(c for c in text[2:] if c.isprintable() and c != "\ufffd")
        stopped = await completion(http, config, {"prompt": tokens, "max_tokens": 8, "stop": [stop], **GREEDY})
        assert stopped["choices"][0] == {**stopped["choices"][0], "text": text[: text.index(stop)],
                                         "finish_reason": "stop"}
        chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5, "stream": True,
                **GREEDY}
        async with http.post(url(config, "/v1/chat/completions"), json=chat) as response:
            chat_events = await sse_events(response)
        assert chat_events[-1] == "[DONE]" and chat_events[-2]["choices"][0]["finish_reason"] == "length"
        async with http.get(url(config, "/v1/cluster")) as response:
            cluster = await response.json()
        assert cluster["prefix_blocks"]["reused_local"] == 8 and cluster["index"]["num_keys"] >= 4
        # the instances profiled themselves and report their fitted models; every served request is scored
        assert all(i["model"]["prefill_coefficients"] for i in cluster["instances"])
        assert cluster["scheduler"]["num_model_reports"] >= 2
        assert cluster["predictions"]["ttft"]["recent"]["count"] == 4
        assert {i["name"]: i["is_up"] for i in cluster["instances"]} == {"p0": True, "d0": True}
        async with http.get(url(config, "/metrics")) as response:
            metrics = await response.text()
        assert 'mooncaked_prefix_blocks_reused_total{location="local"} 8.0' in metrics
        assert 'mooncaked_requests_total{status="ok"} 4.0' in metrics
        one = await completion(http, config, {"prompt": tokens, "max_tokens": 1, **GREEDY})
        assert one["usage"]["completion_tokens"] == 1 and one["choices"][0]["finish_reason"] == "length"
        decode = roles["d0"]
        assert isinstance(decode, DecodeRole) and not decode.reservations and not decode.loop.running
        store = await decode.worker.stores.client("s0")
        assert store.is_local, "the pool path the worker derives is the store's: mapped, not over the network"


async def test_overload_answers_429_and_a_disconnect_frees_the_decode_slot(tmp_path: Path) -> None:
    config = make_config(tmp_path, worker={"max_batch_size": 1}, scheduler={"admission": "early_rejection"},
                         conductor={"retry_after_s": 2})
    tokens = prompt(2, 40)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        decode = roles["d0"]
        assert isinstance(decode, DecodeRole)
        body = {"prompt": tokens, "max_tokens": 900, "stream": True, **GREEDY}
        long_running = await http.post(url(config, "/v1/completions"), json=body)
        assert long_running.status == 200
        await long_running.content.readline()  # the first token is out: the request holds the only slot
        async with http.post(url(config, "/v1/completions"), json={"prompt": tokens, "max_tokens": 4}) as response:
            assert response.status == 429 and response.headers["Retry-After"] == "2"
            assert "decode instance is full" in (await response.json())["error"]["message"]
        long_running.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 5.0
        while decode.loop.running or decode.reservations:
            assert time.monotonic() < deadline, "the decode instance kept the cancelled request"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # one LOAD poll: the conductor sees the slot free
        done = await completion(http, config, {"prompt": tokens, "max_tokens": 3, **GREEDY})
        assert done["usage"]["completion_tokens"] == 3


async def test_restarted_conductor_rebuilds_its_index_and_reuses_prefixes(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    tokens = prompt(3, 64)
    ids, text = expected_text(tokens + [7, 8, 9], 4)
    async with running_roles(config, ["s0", "p0", "d0"]), aiohttp.ClientSession() as http:
        async with running_roles(config, ["c0"]):
            await completion(http, config, {"prompt": tokens, "max_tokens": 2, **GREEDY})
        conductor = make_role(config, config.instance_named("c0"))
        assert isinstance(conductor, ConductorRole)
        await conductor.start()
        try:
            assert conductor.view is not None and conductor.backend is not None
            probe = parse_completion_request({"prompt": tokens + [7, 8, 9]}, request_id="probe",
                                             model_ids=conductor.backend.model_ids())
            prepared = await conductor.backend.prepare(probe)
            assert conductor.view.index.prefix_lengths(prepared.block_keys) == {"s0": 4}  # from the dump
            reply = await completion(http, config, {"prompt": tokens + [7, 8, 9], "max_tokens": 4, **GREEDY})
            assert reply["choices"][0]["text"] == text
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        finally:
            await conductor.stop()


async def test_colocated_cluster_prefills_inline_on_decode(tmp_path: Path) -> None:
    config = make_config(tmp_path, with_prefill=False)
    tokens = prompt(4, 50)
    _, text = expected_text(tokens, 6)
    async with running_roles(config, ["s0", "d0", "c0"]), aiohttp.ClientSession() as http:
        first = await completion(http, config, {"prompt": tokens, "max_tokens": 6, **GREEDY})
        assert first["choices"][0]["text"] == text
        again = await completion(http, config, {"prompt": tokens, "max_tokens": 6, **GREEDY})
        assert again["choices"][0]["text"] == text and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        one = await completion(http, config, {"prompt": tokens, "max_tokens": 1, **GREEDY})
        assert one["usage"]["completion_tokens"] == 1


async def test_a_decode_instance_dying_mid_stream_ends_it_with_an_error_and_serving_goes_on(tmp_path: Path) -> None:
    config = make_config(tmp_path, runtime={"drain_timeout_s": 0.3})
    tokens = prompt(5, 30)
    async with running_roles(config, ["s0", "p0"]), aiohttp.ClientSession() as http:
        decode = DecodeRole(config, config.instance_named("d0"))
        await decode.start()
        conductor = ConductorRole(config, config.instance_named("c0"))
        try:
            await conductor.start()
            body = {"prompt": tokens, "max_tokens": 900, "stream": True, **GREEDY}
            async with http.post(url(config, "/v1/completions"), json=body) as response:
                await response.content.readline()
                await decode.stop()
                events = await asyncio.wait_for(sse_events(response), 5.0)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable"
            decode = DecodeRole(config, config.instance_named("d0"))
            await decode.start()
            await until_healthy(http, config)
            done = await completion(http, config, {"prompt": tokens, "max_tokens": 3, **GREEDY})
            assert done["usage"]["completion_tokens"] == 3
        finally:
            await conductor.stop()
            await decode.stop()


async def until_healthy(http: aiohttp.ClientSession, config: Config, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(url(config, "/health")) as health:
            if health.status == 200:
                return
        assert time.monotonic() < deadline, "the conductor never saw every needed role up"
        await asyncio.sleep(0.05)


async def test_a_prefix_on_another_host_is_fetched_then_served_locally(tmp_path: Path) -> None:
    """p2 (host .2) prefills first; with p2 gone, Algorithm 1 sends the same prefix to p3 (host .3) with a fetch
    from s2's store over TCP (replicating the blocks); the next time p3 finds them in its own store."""
    config = cluster_config(tmp_path, [
        instance("s2", "store", "127.0.0.2"), instance("p2", "prefill", "127.0.0.2"),
        instance("s3", "store", "127.0.0.3"), instance("p3", "prefill", "127.0.0.3"),
        instance("s4", "store", "127.0.0.4"), instance("d0", "decode", "127.0.0.4"), instance("c0", "conductor"),
    ], worker={"inline_prefill_max_tokens": 0, "profile_s": 0}, rpc={"connect_timeout_s": 0.3})  # unprofiled: a tie
    tokens = prompt(6, 70)
    _, text = expected_text(tokens, 3)
    body = {"prompt": tokens, "max_tokens": 3, **GREEDY}
    async with running_roles(config, ["s2", "s3", "s4", "p3", "d0"]), aiohttp.ClientSession() as http:
        async with running_roles(config, ["p2", "c0"]):
            assert (await completion(http, config, body))["choices"][0]["text"] == text  # on p2: first on ties
            async with http.get(url(config, "/v1/cluster")) as response:
                assert (await response.json())["prefix_blocks"]["computed"] == 4
        async with running_roles(config, ["c0"]):
            fetched = await completion(http, config, body)
            local = await completion(http, config, body)
            async with http.get(url(config, "/v1/cluster")) as response:
                cluster = await response.json()
        assert fetched["choices"][0]["text"] == text and local["choices"][0]["text"] == text
        assert fetched["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert cluster["prefix_blocks"] == {"reused_local": 4, "reused_remote": 4, "computed": 0}


async def test_a_client_gone_during_prefill_leaves_no_reservation_on_decode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(tmp_path, worker={"prefill_chunk": 16, "max_batch_tokens": 16})
    tokens = prompt(7, 1000)  # 63 chunks of 16
    # The prefill holds before its first layer until the conductor has settled the run as cancelled: without the
    # gate a fast prefill finishes inside the conductor's disconnect poll and the request ends "ok".
    gate = threading.Event()
    load_layer = prefill_forward._load_layer

    def gated_load_layer(plans: Any, layer: int) -> None:
        assert gate.wait(timeout=10.0), "the test never released the prefill"
        load_layer(plans, layer)

    monkeypatch.setattr(prefill_forward, "_load_layer", gated_load_layer)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        decode, conductor, store = roles["d0"], roles["c0"], roles["s0"]
        assert isinstance(decode, DecodeRole) and isinstance(conductor, ConductorRole)
        assert isinstance(store, StoreRole) and conductor.view is not None and conductor.backend is not None
        view, backend = conductor.view, conductor.backend

        def free_pages() -> int:  # as the decode instance's last LOAD reply tells them (reservations excluded)
            load = view.decode["d0"].load
            assert load is not None
            return load.num_free_pages

        baseline_free_pages = free_pages()
        body = {"prompt": tokens, "max_tokens": 4, **GREEDY}
        request = asyncio.ensure_future(http.post(url(config, "/v1/completions"), json=body))
        await eventually(lambda: bool(decode.reservations) and view.num_waiting()[0] == 1)
        request.cancel()  # the client goes away before the first token
        await asyncio.gather(request, return_exceptions=True)
        await eventually(lambda: backend.num_active == 0)  # the run settled (and counted its status) at once
        gate.set()
        await eventually(lambda: not decode.reservations, timeout_s=2.0)
        await eventually(lambda: view.num_waiting() == (0, 0) and store.service.core.stats()["num_pending"] == 0)
        await eventually(lambda: free_pages() == baseline_free_pages)
        async with http.get(url(config, "/metrics")) as response:
            assert 'mooncaked_requests_total{status="cancelled"} 1.0' in await response.text()
        done = await completion(http, config, {"prompt": tokens[:40], "max_tokens": 2, **GREEDY})
        assert done["usage"]["completion_tokens"] == 2


async def test_a_prompt_predicted_to_break_the_ttft_slo_is_rejected_with_429(tmp_path: Path) -> None:
    """A profile measured 10 ms per new prompt token: 40 tokens fit the 1.5 s TTFT SLO, 300 do not."""
    samples = [[n, p, 0.01 * (n - p)] for n in (100, 200, 400, 800) for p in (0, n // 2)]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"prefill": samples}))
    # unprofiled instances report no model of their own, so the conductor predicts with the profile file
    config = make_config(tmp_path, scheduler={"prefill_profile": str(profile), "ttft_slo_ms": 1500.0},
                         conductor={"retry_after_s": 3}, worker={"profile_s": 0})
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        short = await completion(http, config, {"prompt": prompt(8, 40), "max_tokens": 2, **GREEDY})
        assert short["usage"]["completion_tokens"] == 2
        body = {"prompt": prompt(9, 300), "max_tokens": 2, **GREEDY}
        async with http.post(url(config, "/v1/completions"), json=body) as response:
            error = (await response.json())["error"]
            assert response.status == 429 and response.headers["Retry-After"] == "3"
        assert "predicted time to first token 3.00 s is over its SLO" in error["message"]
        async with http.get(url(config, "/metrics")) as response:
            metrics = await response.text()
        assert 'mooncaked_rejections_total{reason="ttft_slo"} 1.0' in metrics
        assert 'mooncaked_requests_total{status="ok"} 1.0' in metrics


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(interval_s)
