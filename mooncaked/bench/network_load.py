"""A load client in its own process, for runs inside a test network's host (the conductor's address is there).

`python -m mooncaked.bench.network_load --url http://A:P` reads commands from stdin, one JSON line out each:
- `ready T`: poll GET /v1/cluster until every instance and store is up, at most T seconds:
  {"ready": bool, "at": time.monotonic()}.
- `stream N M T`: N concurrent streamed greedy completions of one fixed prompt, M tokens each, each cut off after
  T seconds; prints {"streaming": true, "running": {decode instance: sequences}} once every stream has 3 chunks
  (or has ended), then one line per request
  {"text", "num_tokens", "error", "start", "end", "is_hung"} and {"done": true, "down_at", "up_again_at"}: when
  the conductor's view (polled meanwhile) first showed a member down, and all up again after that (up to 60 s
  after the streams).
- `converge T`: poll GET /v1/cluster until every instance and store is up again:
  {"converged": bool, "at": time.monotonic()}.
- `metric NAME`: the conductor's /metrics lines starting with NAME: {"lines": [...]}.
Ends when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import aiohttp

PROMPT_SEED = 29
NUM_PROMPT_TOKENS = 48
_POLL_S = 0.2


def fixed_prompt() -> list[int]:
    rng = random.Random(PROMPT_SEED)
    return [rng.randrange(3, 300) for _ in range(NUM_PROMPT_TOKENS)]


async def is_all_up(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with asyncio.timeout(2.0), http.get(f"{url}/v1/cluster") as response:
            cluster = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
    members = [*cluster.get("instances", []), *cluster.get("stores", [])]
    return bool(members) and all(member.get("is_up") for member in members)


async def num_running(http: aiohttp.ClientSession, url: str, count: int, at_most: bool = False) -> dict[str, int]:
    """Each decode instance's running sequences as the conductor's LOAD polls see them, once they count at least
    (`at_most`: at most) `count`, or after 2 s (the polls lag the streams by up to their interval)."""
    deadline = time.monotonic() + 2.0
    while True:
        async with asyncio.timeout(2.0), http.get(f"{url}/v1/cluster") as response:
            cluster = await response.json()
        running = {i["name"]: (i.get("load") or {}).get("num_running", 0) for i in cluster["instances"]
                   if i["role"] == "decode"}
        total = sum(running.values())
        if (total <= count if at_most else total >= count) or time.monotonic() > deadline:
            return running
        await asyncio.sleep(_POLL_S / 4)


async def wait_all_up(http: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await is_all_up(http, url):
            return True
        await asyncio.sleep(_POLL_S)
    return False


async def stream_one(http: aiohttp.ClientSession, url: str, max_tokens: int, timeout_s: float,
                     started: asyncio.Event) -> dict[str, Any]:
    body = {"prompt": fixed_prompt(), "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    texts: list[str] = []
    error, num_tokens, is_hung = None, 0, False
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s), http.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                error = f"HTTP {response.status}: {(await response.text())[:200]}"
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    error = str(event["error"].get("message", event["error"]))
                if event.get("choices"):
                    texts.append(event["choices"][0]["text"])
                    if len(texts) == 3:
                        started.set()
                num_tokens = (event.get("usage") or {}).get("completion_tokens", num_tokens)
    except TimeoutError:
        error, is_hung = f"no end within {timeout_s:g}s", True
    except aiohttp.ClientError as exc:
        error = f"{type(exc).__name__}: {exc}"
    started.set()
    return {"text": "".join(texts), "num_tokens": num_tokens, "error": error, "start": start,
            "end": time.monotonic(), "is_hung": is_hung}


async def stream_many(http: aiohttp.ClientSession, url: str, count: int, max_tokens: int, timeout_s: float) -> None:
    await num_running(http, url, 0, at_most=True)  # the conductor's view no longer counts an earlier round's
    events = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.ensure_future(stream_one(http, url, max_tokens, timeout_s, event)) for event in events]
    fleet: dict[str, float | None] = {"down_at": None, "up_again_at": None}
    watch = asyncio.ensure_future(watch_fleet(http, url, fleet))
    try:
        async with asyncio.timeout(timeout_s + 5.0):  # each stream ends by its own timeout_s
            await asyncio.gather(*(event.wait() for event in events))
            _emit({"streaming": True, "at": time.monotonic(), "running": await num_running(http, url, count)})
            results = await asyncio.gather(*tasks)
        if fleet["down_at"] is None and not await is_all_up(http, url):
            # the streams moved before the watcher's poll in flight (slow while a store is cut off: the view's
            # answer waits for its stats) could show the member down
            fleet["down_at"] = time.monotonic()
        if fleet["down_at"] is not None:
            try:
                async with asyncio.timeout(60.0):
                    await watch
            except TimeoutError:
                pass  # never all up again: up_again_at stays None
    finally:
        for task in [*tasks, watch]:
            task.cancel()
    for result in results:
        _emit(result)
    _emit({"done": True, **fleet})


async def watch_fleet(http: aiohttp.ClientSession, url: str, fleet: dict[str, float | None]) -> None:
    """Note in `fleet` when the conductor's view first showed a member down, and when all were up again after it;
    runs until then or until cancelled."""
    while True:
        is_up = await is_all_up(http, url)
        if not is_up and fleet["down_at"] is None:
            fleet["down_at"] = time.monotonic()
        if is_up and fleet["down_at"] is not None:
            fleet["up_again_at"] = time.monotonic()
            return
        await asyncio.sleep(_POLL_S)


async def metric_lines(http: aiohttp.ClientSession, url: str, name: str) -> list[str]:
    async with asyncio.timeout(5.0), http.get(f"{url}/metrics") as response:
        text = await response.text()
    return [line for line in text.splitlines() if line.startswith(name)]


async def serve(url: str) -> None:
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command, *args = line.split()
            if command == "ready":
                _emit({"ready": await wait_all_up(http, url, float(args[0])), "at": time.monotonic()})
            elif command == "converge":
                _emit({"converged": await wait_all_up(http, url, float(args[0])), "at": time.monotonic()})
            elif command == "stream":
                await stream_many(http, url, int(args[0]), int(args[1]), float(args[2]))
            elif command == "metric":
                _emit({"lines": await metric_lines(http, url, args[0])})
            else:
                _emit({"error": f"unknown command {line.strip()!r}"})


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mooncaked.bench.network_load")
    parser.add_argument("--url", required=True)
    asyncio.run(serve(parser.parse_args(argv).url))


if __name__ == "__main__":
    main()
