"""The steady load of `bench chaos`: streaming requests, each ending as exactly one outcome.

1. `SteadyLoad.run()` sends streaming greedy completions at Poisson times while `is_sending` holds; every
   request is one `Outcome` in `outcomes` from the moment it is sent.
2. A request ends as `completed` (data: [DONE] after all its tokens, as its usage counts them), `error` (an
   HTTP error, an error event, a broken connection), `hung` (no end within `timeout_s`: the client gives up and
   cancels it) or `lost` (the stream ended with neither [DONE] nor an error, or [DONE] came with tokens missing:
   a silent truncation).
3. `in_flight()` names the requests not ended yet; `wait_ended(ids, timeout_s)` waits for some to end.
Request i goes by `X-Request-Id: chaos-<i>`, so an instance's LOAD names the requests it holds (`index_of`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp

OUTCOMES = ("completed", "error", "hung", "lost")
ID_PREFIX = "chaos-"


def index_of(attempt_id: str) -> int | None:
    """The load's index of a request from the id an instance knows it by (`chaos-<i>~<attempt>...`), or None."""
    request_id = attempt_id.split("~", 1)[0]
    if not request_id.startswith(ID_PREFIX) or not request_id[len(ID_PREFIX):].isdigit():
        return None
    return int(request_id[len(ID_PREFIX):])


@dataclass
class Outcome:
    index: int
    sent_at: float
    ended_at: float = 0.0
    status: str = ""  # "" while in flight, then one of OUTCOMES
    num_tokens: int = 0
    detail: str = ""


class SteadyLoad:
    """Owns the load's request tasks and their outcomes."""

    def __init__(self, url: str, *, rate: float, prompt_tokens: int, output_tokens: int, timeout_s: float,
                 seed: int) -> None:
        self.url = url.rstrip("/")
        self.rate = rate
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.timeout_s = timeout_s
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self.is_sending = True
        self.is_running = True
        self._tasks: set[asyncio.Task[None]] = set()
        self._ended = asyncio.Event()

    def prompt(self, index: int) -> list[int]:
        """A shared system prefix (half the prompt: reusable KV) and a part unique to the request."""
        shared = [3 + (7 * i) % 251 for i in range(self.prompt_tokens // 2)]
        unique = random.Random(index).choices(range(3, 255), k=self.prompt_tokens - len(shared))
        return shared + unique

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Until `stop()`: send while `is_sending`, one request per exponential gap."""
        while self.is_running:
            await asyncio.sleep(self.rng.expovariate(self.rate))
            if self.is_sending and self.is_running:
                outcome = Outcome(len(self.outcomes), time.monotonic())
                self.outcomes.append(outcome)
                task = asyncio.create_task(self._send(session, outcome))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Stop sending and wait for every request to end (each is bounded by `timeout_s`)."""
        self.is_running = False
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def in_flight(self) -> list[int]:
        return [o.index for o in self.outcomes if not o.status]

    async def wait_ended(self, indices: list[int], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while any(not self.outcomes[i].status for i in indices):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return False
            self._ended.clear()
            try:
                await asyncio.wait_for(self._ended.wait(), left_s)
            except TimeoutError:
                return False
        return True

    async def _send(self, session: aiohttp.ClientSession, outcome: Outcome) -> None:
        body = {"prompt": self.prompt(outcome.index), "max_tokens": self.output_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
        try:
            async with asyncio.timeout(self.timeout_s):
                outcome.status, outcome.detail = await self._stream(session, body, outcome)
        except TimeoutError:
            outcome.status, outcome.detail = "hung", f"no end within {self.timeout_s:g} s"
        except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
            outcome.status, outcome.detail = "error", f"{type(exc).__name__}: {exc}"
        finally:
            outcome.status = outcome.status or "error"
            outcome.ended_at = time.monotonic()
            self._ended.set()

    async def _stream(self, session: aiohttp.ClientSession, body: dict[str, object],
                      outcome: Outcome) -> tuple[str, str]:
        headers = {"X-Request-Id": f"{ID_PREFIX}{outcome.index}"}
        async with session.post(self.url + "/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                return "error", f"HTTP {response.status}: {(await response.text())[:200]}"
            async for raw in response.content:
                line = raw.strip()
                if line == b"data: [DONE]":
                    if outcome.num_tokens != self.output_tokens:
                        return "lost", f"[DONE] after {outcome.num_tokens} of {self.output_tokens} tokens"
                    return "completed", ""
                if line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "error", str(event["error"].get("message", event["error"]))
                    if event.get("usage"):
                        outcome.num_tokens = int(event["usage"]["completion_tokens"])
        return "lost", "the stream ended with neither [DONE] nor an error"
