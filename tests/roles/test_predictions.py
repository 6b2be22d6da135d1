"""Predictions and admission policies through an in-process cluster: instance-owned models, one meaning per policy."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.prefill import forward as prefill_forward
from mooncaked.roles.worker.prefill.role import PrefillRole
from mooncaked.sched.predictors import DecodeStepPredictor, PrefillTimePredictor
from tests.roles.cluster_fixtures import running_roles
from tests.roles.test_conductor_flow import GREEDY, completion, eventually, make_config, prompt, url

SLOW_STEP = (1.0, 0.0, 0.0)  # a step model saying every decode step takes 1 s


async def test_none_queues_at_a_full_decode_instance_and_never_answers_429(tmp_path: Path) -> None:
    # one sequence at a time, and a TBT SLO every step breaks: under `none` both only make requests wait
    config = make_config(tmp_path, scheduler={"admission": "none", "tbt_slo_ms": 1.0, "ttft_slo_ms": 1.0},
                         worker={"max_batch_size": 1})
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        decode = roles["d0"]
        assert isinstance(decode, DecodeRole)
        bodies = [{"prompt": prompt(20 + i, 40), "max_tokens": 6, **GREEDY} for i in range(4)]
        results = await asyncio.gather(*(completion(http, config, body) for body in bodies))
        assert all(r["usage"]["completion_tokens"] == 6 for r in results)
        assert not decode.reservations and not decode.loop.running
        async with http.get(url(config, "/metrics")) as response:
            assert "mooncaked_rejections_total{" not in await response.text()


async def _slow_decode_model(roles: dict[str, object]) -> None:
    """Give the decode instance a model saying each step takes 1 s; wait until the conductor predicts with it."""
    decode, conductor = roles["d0"], roles["c0"]
    assert isinstance(decode, DecodeRole) and isinstance(conductor, ConductorRole) and conductor.view is not None
    decode.worker.perf.decode_fit = DecodeStepPredictor(SLOW_STEP)
    view = conductor.view
    await eventually(lambda: view.predictors.decode_for("d0").coefficients == SLOW_STEP)


@pytest.mark.parametrize(("admission", "reason", "num_wasted"), [
    ("baseline", "decode_refused_after_prefill", 1), ("early_rejection", "tbt_slo", 0),
    ("early_rejection_predicted", "tbt_slo", 0)])
async def test_baseline_refuses_after_prefill_and_early_rejection_before_it(
        tmp_path: Path, admission: str, reason: str, num_wasted: int) -> None:
    config = make_config(tmp_path, scheduler={"admission": admission, "tbt_slo_ms": 500.0})
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        await _slow_decode_model(roles)
        prefill, decode = roles["p0"], roles["d0"]
        assert isinstance(prefill, PrefillRole) and isinstance(decode, DecodeRole)
        num_before = prefill.worker.perf.num_samples()["prefill_live"]
        body = {"prompt": prompt(30, 40), "max_tokens": 4, **GREEDY}
        async with http.post(url(config, "/v1/completions"), json=body) as response:
            error = (await response.json())["error"]
            assert response.status == 429 and response.headers["Retry-After"], error
        async with http.get(url(config, "/metrics")) as response:
            assert f'mooncaked_rejections_total{{reason="{reason}"}} 1.0' in await response.text()
        assert prefill.worker.perf.num_samples()["prefill_live"] - num_before == num_wasted
        await eventually(lambda: not decode.reservations)


async def _first_prediction(http: aiohttp.ClientSession, config_url: str, seed: int) -> tuple[float, float]:
    body = {"prompt": prompt(seed, 512), "max_tokens": 2, **GREEDY}
    async with http.post(config_url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        predicted_header = float(response.headers["X-Mooncaked-Predicted-TTFT-Ms"]) / 1000
    async with http.get(config_url + "/v1/cluster") as response:
        record = (await response.json())["predictions"]["recent"][-1]
    assert abs(record["predicted_ttft_s"] - predicted_header) < 1e-3
    return record["predicted_ttft_s"], record["actual_ttft_s"]


async def test_a_cold_conductor_predicts_its_first_request_and_a_restarted_one_at_once(tmp_path: Path) -> None:
    """The instances profile themselves, so the first prediction of a fresh conductor, and of a restarted one, is
    the prefill instance's own fitted model (not the device fallback), with no sample of its own yet. How close
    that model comes to the measured TTFT is a timing, measured by `bench serve` (`ttft_prediction_mape_first20`),
    not here; so the tiny model serves (SmolLM2's shape took 15-20 s of the suite for the same assertion)."""
    config = make_config(tmp_path, model={"source": "random:tiny", "max_model_len": 2048},
                         kv={"block_size": 64}, store={"dram_bytes": 256 << 20},
                         worker={"profile_s": 1.0, "prefill_chunk": 1024, "max_batch_tokens": 4096,
                                 "num_kv_pages": 64, "max_batch_size": 8})
    base = url(config, "")
    async with running_roles(config, ["s0", "p0", "d0"]) as workers, aiohttp.ClientSession() as http:
        prefill = workers["p0"]
        assert isinstance(prefill, PrefillRole) and prefill.load is not None
        for seed in (40, 41):  # the second conductor starts after the first stopped: no state carries over
            async with running_roles(config, ["c0"]):
                load = prefill.load
                coefficients = load.coefficients(time.monotonic()).prefill
                assert coefficients, "the prefill instance's profile fitted no model"
                model = PrefillTimePredictor(coefficients)
                expected = model.predict(512, 0) + load.overhead.value  # idle: no queue, nothing cached
                predicted, actual = await _first_prediction(http, base, seed)
            assert predicted == pytest.approx(expected, rel=0.02), (seed, predicted, expected, actual)
            assert actual > 0


async def test_a_batched_prefill_splits_its_time_into_per_request_samples(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts queued behind a held one run as one batch: its two samples sum to that batch's time."""
    config = make_config(tmp_path, worker={"prefill_chunk": 256, "max_batch_tokens": 512, "profile_s": 0})
    gate = threading.Event()
    load_layer = prefill_forward._load_layer

    def gated_load_layer(plans: Any, layer: int) -> None:
        assert gate.wait(timeout=10.0), "the test never released the prefill"
        load_layer(plans, layer)

    monkeypatch.setattr(prefill_forward, "_load_layer", gated_load_layer)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        prefill = roles["p0"]
        assert isinstance(prefill, PrefillRole)
        first = asyncio.ensure_future(completion(http, config, {"prompt": prompt(50, 30), "max_tokens": 1, **GREEDY}))
        await eventually(lambda: bool(prefill.running))
        rest = [asyncio.ensure_future(completion(http, config, {"prompt": prompt(51 + i, 40 + 60 * i),
                                                                  "max_tokens": 1, **GREEDY})) for i in range(2)]
        await eventually(lambda: len(prefill._queue) == 2)
        gate.set()
        await asyncio.gather(first, *rest)
        samples = list(prefill.worker.perf._live_prefill)
        assert [n for n, _, _ in samples] == [30, 40, 100]
        step = prefill.metrics.registry.get_sample_value("mooncaked_step_time_seconds_sum", {"phase": "prefill"})
        assert step is not None and sum(s for _, _, s in samples) == pytest.approx(step, rel=1e-9)
        assert samples[2][2] > samples[1][2] > 0  # the longer prompt of the batch pays more of it


async def test_a_request_whose_pages_free_within_its_ttft_slo_is_deferred_not_refused(tmp_path: Path) -> None:
    """13 of the decode instance's 16 pages held by a sequence the conductor knows only from LOAD (predicted to
    run 3 more steps of 1 s); a request needing 4 pages is admitted with its decode start deferred to that
    hold's end (3 s, within the TTFT SLO) instead of refused as decode_full, its first token held back until its
    decode starts; it decodes once the pages free."""
    config = make_config(tmp_path, scheduler={"admission": "early_rejection_predicted", "tbt_slo_ms": 5000.0,
                                              "max_decode_defer_s": 10.0},
                         conductor={"default_max_tokens": 3},
                         worker={"num_kv_pages": 16, "page_wait_s": 30.0, "profile_s": 0.0})
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        await _slow_decode_model(roles)
        decode, conductor = roles["d0"], roles["c0"]
        assert isinstance(decode, DecodeRole) and decode.worker.pages is not None
        assert isinstance(conductor, ConductorRole) and conductor.view is not None
        view = conductor.view
        held = decode.worker.pages.allocate(13, owner="longer-than-predicted")
        d0 = next(worker for worker in view.workers if worker.instance.name == "d0")
        await eventually(lambda: d0.load is not None and d0.load.num_free_pages == 3)
        body = {"prompt": prompt(60, 40), "max_tokens": 20, **GREEDY}  # 60 tokens: 4 pages
        answer = asyncio.ensure_future(completion(http, config, body))
        await eventually(lambda: decode.reservations.num_queued_pages() == 4 or answer.done(), timeout_s=20.0)
        assert not answer.done()  # waiting for its pages, not refused
        decode.worker.pages.free(held, "longer-than-predicted")
        await decode.reservations.pages_freed()
        result = await answer
        assert result["usage"]["completion_tokens"] == 20
        async with http.get(url(config, "/metrics")) as response:
            assert "mooncaked_rejections_total{" not in await response.text()
