"""`mooncaked bench serve --url URL`: an OpenAI streaming load generator with vLLM's serving metrics.

1. Build the requests: random prompts arriving as a Poisson process at `--request-rate`, or a Mooncake trace
   replayed on its own timestamps (`--trace`, scaled by `--block-scale`, `--speed`, `--output-scale`).
2. Send each at its arrival time (at most `--max-concurrency` in flight) as a streaming request with
   `ignore_eos`, timing every chunk; each request ends within `--timeout-s`, the whole run within
   `--duration-s` (requests still in flight then are cancelled and counted as unfinished).
3. Summarize (see `stats`): print a table (serve_report.py), write `--json`. 429 answers count as rejected,
   other errors as failed.
   Against mooncaked, the server's predicted TTFT and TBT (response headers) are compared with the measured
   ones (see `prediction_error`): `ttft_prediction_mape`, `ttft_prediction_bias`, ... overall and for the first 20.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from mooncaked.bench.prediction_error import prediction_summary
from mooncaked.bench.report import report
from mooncaked.bench.serve_report import Progress, format_table
from mooncaked.bench.stats import RequestResult, parse_goodput, summarize
from mooncaked.bench.trace import (
    BenchRequest, TokenBlocks, load_trace, random_requests, tokens_to_text, trace_requests,
)


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    endpoint: str  # "completions" | "chat"
    model: str | None  # None: the server's first model
    api_key: str | None
    requests: tuple[BenchRequest, ...]
    max_concurrency: int | None
    timeout_s: float
    duration_s: float
    slos_ms: dict[str, float]
    show_progress: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--model", default=None, help="model id (default: the server's first model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", choices=("random", "trace"), default="random")
    parser.add_argument("--trace", default=None, help="Mooncake JSONL trace to replay (implies --dataset trace)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 100 random, or the whole trace")
    parser.add_argument("--input-len", type=int, default=128, help="random dataset prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="random dataset output tokens")
    parser.add_argument("--vocab-size", type=int, default=49152, help="token ids are drawn below this")
    parser.add_argument("--block-scale", type=int, default=16, help="tokens per 512-token trace block")
    parser.add_argument("--speed", type=float, default=1.0, help="trace time runs this many times faster")
    parser.add_argument("--output-scale", type=float, default=1.0, help="trace output lengths are scaled by this")
    parser.add_argument("--max-input-len", type=int, default=None, help="cut trace prompts to this many tokens")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="random dataset: Poisson arrivals per second (inf: all at once); traces keep their times")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS tbt:MS e2el:MS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--duration-s", type=float, default=1800.0, help="cap on the whole run")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", default=None, help="write the result here")


def build_config(args: argparse.Namespace) -> ServeBenchConfig:
    if args.trace is not None:
        args.dataset = "trace"
    if args.dataset == "trace" and args.trace is None:
        raise ValueError("--dataset trace needs --trace FILE")
    for name in ("num_prompts", "input_len", "output_len", "block_scale", "max_concurrency", "max_input_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.timeout_s <= 0 or args.duration_s <= 0:
        raise ValueError("--timeout-s and --duration-s must be positive")
    blocks = TokenBlocks(block_tokens=args.block_scale, vocab_size=args.vocab_size, seed=args.seed)
    if args.dataset == "trace":
        records = load_trace(args.trace, limit=args.num_prompts)
        requests = trace_requests(records, blocks, speed=args.speed, output_scale=args.output_scale,
                                  max_input_len=args.max_input_len)
    else:
        requests = random_requests(args.num_prompts or 100, input_len=args.input_len, output_len=args.output_len,
                                   request_rate=args.request_rate, blocks=blocks)
    return ServeBenchConfig(
        url=args.url.rstrip("/"), endpoint=args.endpoint, model=args.model, api_key=args.api_key,
        requests=tuple(requests), max_concurrency=args.max_concurrency, timeout_s=args.timeout_s,
        duration_s=args.duration_s, slos_ms=parse_goodput(args.goodput), show_progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except (ValueError, OSError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    result = asyncio.run(run_benchmark(config))
    report(result, format_table(result), args.json)
    return 0 if result["completed"] else 1


async def run_benchmark(config: ServeBenchConfig) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        model = config.model or await _first_model(session, config)
        runner = _Runner(session, config, model)
        started = time.perf_counter()
        await runner.run()
        duration_s = time.perf_counter() - started
    runner.progress.close()
    results = runner.results
    return {
        "url": config.url, "endpoint": config.endpoint, "model": model,
        "num_prompts": len(config.requests), "max_concurrency": config.max_concurrency,
        "goodput_slos_ms": config.slos_ms,
        **summarize(results, duration_s, config.slos_ms),
        "unfinished": runner.num_unfinished,
        "not_sent": len(config.requests) - runner.num_sent,
        "input_lens": [r.num_prompt_tokens for r in results],
        "output_lens": [r.num_output_tokens for r in results],
        "ttfts_ms": [r.ttft_s * 1e3 for r in results],
        "e2els_ms": [r.e2el_s * 1e3 for r in results],
        "errors": [r.error for r in results],
        **prediction_summary(results),
    }


async def _first_model(session: aiohttp.ClientSession, config: ServeBenchConfig) -> str:
    timeout = aiohttp.ClientTimeout(total=min(config.timeout_s, 30.0))
    async with session.get(f"{config.url}/v1/models", timeout=timeout) as response:
        response.raise_for_status()
        models = await response.json()
    return str(models["data"][0]["id"])


class _Runner:
    """Owns one run's in-flight tasks and results."""

    def __init__(self, session: aiohttp.ClientSession, config: ServeBenchConfig, model: str) -> None:
        self.session = session
        self.config = config
        self.model = model
        self.results: list[RequestResult] = []
        self.num_sent = 0
        self.num_unfinished = 0
        self.semaphore = asyncio.Semaphore(config.max_concurrency or len(config.requests) or 1)
        self.progress = Progress(len(config.requests), is_enabled=config.show_progress)

    async def run(self) -> None:
        started = time.perf_counter()
        deadline = started + self.config.duration_s
        tasks = []
        for index, request in enumerate(self.config.requests):
            send_at = started + request.arrival_s
            if send_at >= deadline:
                break
            await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
            tasks.append(asyncio.create_task(self._send_limited(request, index)))
            self.num_sent += 1
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.num_unfinished = len(pending)

    async def _send_limited(self, request: BenchRequest, index: int) -> None:
        async with self.semaphore:
            result = await send_request(self.session, self.config, self.model, request, index)
        self.results.append(result)
        self.progress.update(result)


def request_payload(config: ServeBenchConfig, model: str, request: BenchRequest) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {
        "model": model, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "temperature": 0.0,
    }
    if config.endpoint == "chat":
        messages = [{"role": "user", "content": tokens_to_text(request.token_ids)}]
        return "/v1/chat/completions", {**common, "messages": messages, "max_completion_tokens": request.max_tokens}
    return "/v1/completions", {**common, "prompt": list(request.token_ids), "max_tokens": request.max_tokens}


async def send_request(
    session: aiohttp.ClientSession, config: ServeBenchConfig, model: str, request: BenchRequest, index: int = -1
) -> RequestResult:
    path, payload = request_payload(config, model, request)
    result = RequestResult(is_success=False, status=0, num_prompt_tokens=len(request.token_ids), index=index)
    started = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        async with session.post(config.url + path, json=payload, timeout=timeout) as response:
            result.status = response.status
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            result.predicted_ttft_s = _header_seconds(response, "X-Mooncaked-Predicted-TTFT-Ms")
            result.predicted_tbt_s = _header_seconds(response, "X-Mooncaked-Predicted-TBT-Ms")
            await _read_stream(response, result, started)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2el_s = time.perf_counter() - started
    return result


def _header_seconds(response: aiohttp.ClientResponse, name: str) -> float | None:
    try:
        return float(response.headers[name]) / 1000
    except (KeyError, ValueError):
        return None


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult, started: float) -> None:
    last_chunk_at = started
    num_chunks = 0
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            result.is_success = not result.error
            break
        event = json.loads(data)
        if "error" in event:
            result.error = f"error event: {event['error'].get('message', event['error'])}"
            continue
        now = time.perf_counter()
        if event.get("choices"):
            if num_chunks == 0:
                result.ttft_s = now - started
            else:
                result.chunk_gaps_s.append(now - last_chunk_at)
            last_chunk_at = now
            num_chunks += 1
        if event.get("usage"):
            result.num_prompt_tokens = event["usage"]["prompt_tokens"]
            result.num_output_tokens = event["usage"]["completion_tokens"]
    if not result.num_output_tokens:
        result.num_output_tokens = num_chunks
    if not result.is_success and not result.error:
        result.error = "the stream ended without data: [DONE]"
