"""`mooncaked bench agents`: what agent clients send, through the official `openai` client (issue 31's checks).

1. The cluster: `--url` of a running one, or one started here (a store, 1 prefill + 1 decode instance with one torch
   thread each, a conductor; `--model`, the embedded SmolLM2 by default).
2. JSON: `--num-json` chat requests, each with `response_format` json_schema of a schema hypothesis generates
   (nested objects, arrays, enums, numbers with bounds: bench/agent_schemas.py), `--concurrency` at a time;
   `valid_share` is the share of answers that parse and validate (jsonschema).
3. Tools: `--num-tools` chat requests with two tools of generated parameters and `tool_choice: "required"`;
   `tool_valid_share` is the share whose every call names a tool and whose arguments validate.
4. Throughput: `--rounds` rounds, each one batch of `--concurrency` requests of `--throughput-tokens` tokens without
   a constraint, then one with a JSON schema no answer completes sooner; `constrained_tok_s_ratio` is the median
   constrained tokens/s over the median unconstrained (target >= 0.9 at batch 8).
5. TTFT: streamed requests, one prompt (cached after a warm-up), alternately under a schema never seen before and
   under one seen every time (`--ttft-rounds` each): `ttft_new_schema_ms` and `ttft_cached_schema_ms` (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mooncaked.bench.cluster import ClusterProcess, instance, write_config
from mooncaked.bench.report import report

SYSTEM = "You answer with JSON that follows the schema you are given, filled in with plausible values."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running cluster's conductor (default: start one here)")
    parser.add_argument("--model", default="embedded:smollm2", help="model source of a cluster started here")
    parser.add_argument("--model-name", default=None, help="the model field of requests (default: the first served)")
    parser.add_argument("--num-json", type=int, default=200)
    parser.add_argument("--num-tools", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (the decode batch)")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--throughput-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (unconstrained then constrained)")
    parser.add_argument("--ttft-rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout-s", type=float, default=240.0)
    parser.add_argument("--json", help="write the result here")


def draw_schemas(num: int, seed: int) -> list[dict[str, Any]]:
    """`num` schemas from bench/agent_schemas.py, the same for the same seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from mooncaked.bench.agent_schemas import json_schemas

    found: list[dict[str, Any]] = []
    round_seed = seed
    while len(found) < num:
        @hypothesis_seed(round_seed)
        @settings(max_examples=num, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(json_schemas(is_random_model=False))
        def collect(schema: dict[str, Any]) -> None:
            found.append(schema)

        collect()
        round_seed += 1
    return found[:num]


def is_valid(value: Any, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


RATE_LIMIT_WAIT_S = 300.0  # how long one request may keep being refused with 429 before the run fails


async def in_batches(calls: list[Callable[[], Awaitable[Any]]], concurrency: int,
                     rate_limited: tuple[type[BaseException], ...] = ()) -> list[Any]:
    """Run `calls`, at most `concurrency` at once. A call refused with one of `rate_limited` (the server's 429: a
    full decode instance under early rejection) is sent again after its Retry-After, for up to RATE_LIMIT_WAIT_S:
    a refusal is the server protecting its SLOs, not an answer to score."""
    gate = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        deadline = time.monotonic() + RATE_LIMIT_WAIT_S
        async with gate:
            while True:
                try:
                    return await call()
                except rate_limited as exc:
                    if time.monotonic() >= deadline:
                        raise
                    headers = getattr(getattr(exc, "response", None), "headers", {})
                    await asyncio.sleep(min(float(headers.get("retry-after", 1.0)), 10.0))
    return await asyncio.gather(*(one(call) for call in calls))


class Agents:
    """Owns the client and the model name; each method is one part of the workload."""

    def __init__(self, client: Any, model: str, args: argparse.Namespace) -> None:
        self.client, self.model, self.args = client, model, args

    async def json_answer(self, schema: dict[str, Any], index: int) -> dict[str, Any]:
        answer = await self.client.chat.completions.create(
            model=self.model, max_tokens=self.args.max_tokens, temperature=0.0, seed=index,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"Schema: {json.dumps(schema, separators=(',', ':'))}"}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                    "strict": True}})
        text = answer.choices[0].message.content or ""
        try:
            valid = is_valid(json.loads(text), schema)
        except ValueError:
            valid = False
        return {"valid": valid, "finish_reason": answer.choices[0].finish_reason, "text": text[:300],
                "tokens": answer.usage.completion_tokens}

    async def tool_answer(self, first: dict[str, Any], second: dict[str, Any], index: int) -> dict[str, Any]:
        parameters = {"lookup": first, "record": second}
        tools = [{"type": "function", "function": {"name": name, "description": f"{name} something",
                                                   "parameters": schema}} for name, schema in parameters.items()]
        answer = await self.client.chat.completions.create(
            model=self.model, max_tokens=self.args.max_tokens, temperature=0.0, seed=index, tools=tools,
            tool_choice="required", messages=[{"role": "user", "content": "Use a tool for this task."}])
        calls = answer.choices[0].message.tool_calls or []
        valid = bool(calls)
        for call in calls:
            try:
                valid = valid and call.function.name in parameters and is_valid(
                    json.loads(call.function.arguments), parameters[call.function.name])
            except ValueError:
                valid = False
        return {"valid": valid, "finish_reason": answer.choices[0].finish_reason, "num_calls": len(calls),
                "calls": [(c.function.name, c.function.arguments[:200]) for c in calls[:3]],
                "content": (answer.choices[0].message.content or "")[:300]}

    async def throughput(self, constraint: dict[str, Any] | None) -> float:
        """Tokens per second of one batch of `--concurrency` requests of `--throughput-tokens` tokens."""
        num_tokens = self.args.throughput_tokens

        async def one(index: int) -> int:
            answer = await self.client.chat.completions.create(
                model=self.model, max_tokens=num_tokens, temperature=0.7, seed=index,
                messages=[{"role": "user", "content": f"List {num_tokens} things, number {index}."}],
                extra_body={"ignore_eos": True, **({} if constraint is None else {"response_format": constraint})})
            return int(answer.usage.completion_tokens)
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(self.args.concurrency)))
        return sum(tokens) / (time.perf_counter() - started)

    async def ttft_ms(self, schema: dict[str, Any]) -> float:
        started = time.perf_counter()
        stream = await self.client.chat.completions.create(
            model=self.model, max_tokens=4, temperature=0.0, stream=True,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
        first = None
        async for _ in stream:
            first = first or time.perf_counter()
        return ((first or time.perf_counter()) - started) * 1000


def long_array_schema(num_tokens: int) -> dict[str, Any]:
    """More items than `num_tokens` tokens can write: no answer completes before max_tokens."""
    item = {"type": "object", "required": ["id", "name"], "additionalProperties": False,
            "properties": {"id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 12}}}
    return {"type": "json_schema", "json_schema": {"name": "items", "schema": {
        "type": "object", "required": ["items"], "additionalProperties": False,
        "properties": {"items": {"type": "array", "minItems": num_tokens, "items": item}}}}}


def fresh_schema(index: int) -> dict[str, Any]:
    """A schema no conductor has compiled: a property name of its own."""
    return {"type": "object", "required": [f"answer_{index}_{os.getpid()}"], "additionalProperties": False,
            "properties": {f"answer_{index}_{os.getpid()}": {"type": "boolean"}}}


async def run_workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600.0) as client:
        model = args.model_name or (await client.models.list()).data[0].id
        agents = Agents(client, model, args)
        schemas = draw_schemas(args.num_json + 2 * args.num_tools, args.seed)
        pairs = schemas[args.num_json:]
        json_calls: list[Callable[[], Awaitable[Any]]] = [
            functools.partial(agents.json_answer, schema, i) for i, schema in enumerate(schemas[: args.num_json])]
        json_runs = await in_batches(json_calls, args.concurrency, (openai.RateLimitError,))
        tool_calls: list[Callable[[], Awaitable[Any]]] = [
            functools.partial(agents.tool_answer, pairs[2 * i], pairs[2 * i + 1], i) for i in range(args.num_tools)]
        tool_runs = await in_batches(tool_calls, args.concurrency, (openai.RateLimitError,))
        plain, constrained = [], []
        for _ in range(args.rounds):
            plain.append(await agents.throughput(None))
            constrained.append(await agents.throughput(long_array_schema(args.throughput_tokens)))
        cached = fresh_schema(-1)
        await agents.ttft_ms(cached)  # warms the prompt's prefix and compiles `cached`
        new_ms, cached_ms = [], []
        for round_index in range(args.ttft_rounds):
            new_ms.append(await agents.ttft_ms(fresh_schema(round_index)))
            cached_ms.append(await agents.ttft_ms(cached))
    return {
        "model": model,
        "valid_share": sum(r["valid"] for r in json_runs) / max(len(json_runs), 1),
        "tool_valid_share": sum(r["valid"] for r in tool_runs) / max(len(tool_runs), 1),
        "constrained_tok_s_ratio": statistics.median(constrained) / statistics.median(plain),
        "ttft_new_schema_ms": statistics.median(new_ms), "ttft_cached_schema_ms": statistics.median(cached_ms),
        "tok_s_unconstrained": plain, "tok_s_constrained": constrained, "ttft_new_runs_ms": new_ms,
        "ttft_cached_runs_ms": cached_ms,
        "json_finish_reasons": _count(r["finish_reason"] for r in json_runs),
        "invalid_json_examples": [r for r in json_runs if not r["valid"]][:5],
        "tool_finish_reasons": _count(r["finish_reason"] for r in tool_runs),
        "invalid_tool_examples": [r for r in tool_runs if not r["valid"]][:5],
    }


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def cluster_config(tmp: Path, args: argparse.Namespace) -> tuple[Path, str]:
    conductor = instance("c0", "conductor")
    sections: dict[str, dict[str, Any]] = {
        "model": {"source": args.model, "name": "bench-model", "max_model_len": 4096},
        "runtime": {"num_threads": 1, "drain_timeout_s": 5.0},
        "store": {"dram_bytes": 1 << 30, "shm_dir": str(tmp)},
        "worker": {"num_kv_pages": 1024, "inline_prefill_max_tokens": 0, "max_batch_size": 64},
        "scheduler": {"admission": "none"},
        "conductor": {"request_timeout_s": 600.0},
    }
    instances = [conductor, instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")]
    return write_config(tmp / "agents.yaml", "bench-agents", instances, sections), \
        f"http://127.0.0.1:{conductor['port']}"


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    kept = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str)) and k != "json"}
    result: dict[str, Any] = {"args": kept, "load_average_start": os.getloadavg()}
    if args.url:
        result.update(await run_workload(args.url.rstrip("/"), args))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
            config_path, url = cluster_config(Path(tmp), args)
            cluster = ClusterProcess(config_path, url, Path(tmp) / "cluster.log")
            await cluster.start(args.start_timeout_s)
            try:
                result.update(await run_workload(url, args))
            finally:
                result["clean_exit"] = await cluster.stop(timeout_s=60.0) == 0
    result["load_average_end"] = os.getloadavg()
    return result


def format_table(result: dict[str, Any]) -> str:
    args = result["args"]
    return "\n".join([
        f"agents: {result['model']}, {args['num_json']} JSON answers, {args['num_tools']} required tool calls, "
        f"batch {args['concurrency']}; load average {result['load_average_start'][0]:.1f} -> "
        f"{result['load_average_end'][0]:.1f}",
        f"  valid_share              {result['valid_share']:.3f}   finish reasons {result['json_finish_reasons']}",
        f"  tool_valid_share         {result['tool_valid_share']:.3f}   finish reasons {result['tool_finish_reasons']}",
        f"  constrained_tok_s_ratio  {result['constrained_tok_s_ratio']:.3f}   "
        f"({statistics.median(result['tok_s_constrained']):.1f} / "
        f"{statistics.median(result['tok_s_unconstrained']):.1f} tok/s, target >= 0.9)",
        f"  TTFT new schema          {result['ttft_new_schema_ms']:.1f} ms   "
        f"cached {result['ttft_cached_schema_ms']:.1f} ms",
    ])


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_bench(args))
    report(result, format_table(result), args.json)
    return 0
