"""Hostile HTTP clients against a live conductor (with a store and a decode instance, tiny model): generated
bodies get an answer or a 4xx in OpenAI's error JSON, never a 500 or a hang; stalled uploads are cut off at
conductor.client_timeout_s and capped per address; the cluster keeps serving everyone else."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.hostile import encode, mutated_bodies, raw_bodies
from tests.api.test_hostile_requests import post_and_check
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles

MODEL = "tiny"
LIMIT = 16


class Live:
    def __init__(self, url: str, port: int, session: aiohttp.ClientSession) -> None:
        self.url, self.port, self.session = url, port, session

    async def good_request(self) -> int:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
        async with self.session.post(f"{self.url}/v1/completions", json=body) as response:
            await response.read()
            return response.status


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    config = cluster_config(
        tmp_path, [instance("c0", "conductor"), instance("s0", "store"), instance("d0", "decode")],
        model={"max_model_len": 96},  # bounds what a generated request may ask to generate
        conductor={"client_timeout_s": 1.0, "max_connections_per_client": LIMIT, "load_poll_interval_s": 0.05,
                   "batch_dir": str(tmp_path / "batches")})
    async with running_roles(config, ["s0", "d0", "c0"]) as roles:
        port = roles["c0"].bound_port  # type: ignore[attr-defined]
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))  # not the address the floods come from
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            live = Live(f"http://127.0.0.1:{port}", port, session)
            for _ in range(200):
                async with session.get(f"{live.url}/health") as response:
                    if response.status == 200:
                        break
                await asyncio.sleep(0.05)
            yield live


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(mutated_bodies(MODEL, max_tokens=2).map(lambda case: (case[0], encode(case[1]))),
                 st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw_bodies)))
async def test_generated_bodies_get_an_answer_or_an_openai_error(live: Live, case: tuple[str, bytes]) -> None:
    route, raw = case
    await asyncio.wait_for(post_and_check(live.session, f"{live.url}{route}", raw), 60)
    assert await live.good_request() == 200


async def stalled_upload(port: int, route: str = "POST /v1/completions", content_type: str = "application/json",
                         first_bytes: bytes = b"{") -> bytes:
    """Headers promising a body, its first bytes, then nothing: what the server answers before it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{route} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: 5000\r\n\r\n".encode() + first_bytes)
        return await reader.read()
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


async def test_stalled_uploads_are_cut_off_and_capped_while_others_are_served(
    live: Live, caplog: pytest.LogCaptureFixture,
) -> None:
    stalled = asyncio.gather(*(stalled_upload(live.port) for _ in range(100)))
    await asyncio.sleep(0.2)
    assert await live.good_request() == 200, "served while 100 uploads stall"
    answers = await asyncio.wait_for(stalled, 30)
    statuses = [answer.split(b" ", 2)[1] for answer in answers]
    assert set(statuses) == {b"408", b"429"} and statuses.count(b"408") >= LIMIT
    for answer in answers:
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] in ("request_timeout",
                                                                                  "too_many_connections")
    assert "did not arrive within conductor.client_timeout_s" in caplog.text


MULTIPART_START = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
                   b'Content-Type: application/jsonl\r\n\r\n{"custom_id": ')


@pytest.mark.parametrize(("route", "content_type", "first_bytes"), [
    ("POST /v1/caches", "application/json", b"{"),
    ("PATCH /v1/caches/cache-0123456789abcdef01234567", "application/json", b"{"),
    ("POST /v1/batches", "application/json", b"{"),
    ("POST /v1/files", "multipart/form-data; boundary=b", MULTIPART_START),
])
async def test_every_route_that_reads_a_body_cuts_off_a_stalled_one(
        live: Live, route: str, content_type: str, first_bytes: bytes) -> None:
    started = time.monotonic()
    answer = await asyncio.wait_for(stalled_upload(live.port, route, content_type, first_bytes), 10)
    assert answer.split(b" ", 2)[1] == b"408", answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 5.0
