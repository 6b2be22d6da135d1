"""The load generator end to end against the real API app (scripted backend) served on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from mooncaked.api.app import create_app
from mooncaked.bench import serve
from tests.api.scripted_backend import MODEL_ID, ScriptedBackend


async def start_server(backend: ScriptedBackend) -> tuple[web.AppRunner, str]:
    app = create_app(backend, api_keys=frozenset({"secret"}), max_body_bytes=1 << 20, request_timeout_s=5.0)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def server() -> AsyncIterator[tuple[ScriptedBackend, str]]:
    backend = ScriptedBackend(token_delay_s=0.005, reject_every=3)
    runner, url = await start_server(backend)
    yield backend, url
    await runner.cleanup()


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


async def test_random_load_counts_rejections_and_times_tokens(server: tuple[ScriptedBackend, str]) -> None:
    backend, url = server
    args = parse_args("--url", url, "--api-key", "secret", "--num-prompts", "6", "--input-len", "8",
                      "--output-len", "4", "--vocab-size", "256", "--request-rate", "100", "--max-concurrency", "2",
                      "--goodput", "ttft:5000", "tbt:0.001", "--no-progress", "--duration-s", "20")
    result = await serve.run_benchmark(serve.build_config(args))
    assert result["model"] == MODEL_ID
    assert (result["completed"], result["rejected"], result["failed"], result["unfinished"]) == (4, 2, 0, 0)
    assert result["total_input_tokens"] == 4 * 8 and result["total_output_tokens"] == 4 * 4
    assert result["mean_itl_ms"] >= 4.0 and result["mean_tpot_ms"] >= 4.0
    assert result["mean_ttft_ms"] > 0 and result["p99_e2el_ms"] >= result["median_e2el_ms"]
    assert result["request_goodput"] == 0.0  # nobody meets tbt <= 1 us
    assert backend.num_prepared == 6 and len(backend.finished) == 4
    # the backend predicted one token delay (5 ms) for TTFT and TBT: the client compares with what it measured
    assert result["num_predicted"] == 4 and len(result["predictions"]) == 4
    assert result["predictions"][0]["predicted_ttft_ms"] == pytest.approx(5.0)
    assert result["ttft_prediction_mape"] is not None and result["ttft_prediction_mape_first20"] is not None
    assert 0 < result["ttft_prediction_bias"] <= 1.0 and 0 < result["tbt_prediction_bias"] <= 1.0


async def test_chat_endpoint_and_unreachable_server(server: tuple[ScriptedBackend, str]) -> None:
    backend, url = server
    backend.reject_every = 0
    args = parse_args("--url", url, "--api-key", "secret", "--endpoint", "chat", "--num-prompts", "2",
                      "--input-len", "5", "--output-len", "3", "--vocab-size", "256", "--no-progress")
    result = await serve.run_benchmark(serve.build_config(args))
    assert result["completed"] == 2 and result["total_output_tokens"] == 6

    with socket.socket() as probe:  # a loopback port with nobody listening
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    args = parse_args("--url", f"http://127.0.0.1:{free_port}", "--model", MODEL_ID, "--num-prompts", "2",
                      "--input-len", "4", "--output-len", "2", "--vocab-size", "256", "--no-progress",
                      "--timeout-s", "2")
    result = await serve.run_benchmark(serve.build_config(args))
    assert (result["completed"], result["failed"], result["rejected"]) == (0, 2, 0)
    assert all(result["errors"])


async def test_duration_cap_stops_the_run(server: tuple[ScriptedBackend, str]) -> None:
    backend, url = server
    backend.reject_every = 0
    backend.token_delay_s = 0.2
    args = parse_args("--url", url, "--api-key", "secret", "--num-prompts", "3", "--input-len", "4",
                      "--output-len", "50", "--vocab-size", "256", "--no-progress", "--duration-s", "0.5")
    result = await serve.run_benchmark(serve.build_config(args))
    assert result["unfinished"] == 3 and result["completed"] == 0
    assert result["duration"] < 2.0
    await asyncio.wait_for(backend.closed_event.wait(), timeout=2.0)


@pytest.fixture
def threaded_server() -> Iterator[str]:
    """The app on its own loop in a thread, so the CLI entry point can run its own asyncio.run."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    backend = ScriptedBackend(token_delay_s=0.002, reject_every=4)
    runner, url = asyncio.run_coroutine_threadsafe(start_server(backend), loop).result(timeout=5)
    yield url
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_cli_trace_replay_writes_json(threaded_server: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1024 + 100 * i, "output_length": 6, "hash_ids": [0, 1, 2 + i]}
            for i in range(4)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "result.json"
    args = parse_args("--url", threaded_server, "--api-key", "secret", "--trace", str(trace), "--block-scale", "8",
                      "--speed", "10", "--output-scale", "0.5", "--vocab-size", "256", "--json", str(out),
                      "--goodput", "ttft:5000", "tpot:5000")
    assert serve.run(args) == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["rejected"]) == (3, 1)
    assert result["total_output_tokens"] == 3 * 3
    assert sorted(result["input_lens"]) == [16, 18, 19, 21]  # round((1024 + 100 i) * 8 / 512)
    assert result["request_goodput"] > 0
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out and "Mean TBT (ms)" in captured.out
    assert "4/4" in captured.err  # the progress bar


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.run(parse_args("--url", "http://127.0.0.1:9", "--dataset", "trace")) == 2
    assert serve.run(parse_args("--url", "http://127.0.0.1:9", "--goodput", "ttft")) == 2
    assert serve.run(parse_args("--url", "http://127.0.0.1:9", "--num-prompts", "0")) == 2
    assert "--goodput" in capsys.readouterr().err
