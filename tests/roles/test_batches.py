"""The Batch API through a whole in-process cluster (tiny random model, loopback), driven by the official `openai`
client: upload, run, output and error files, cancel, a conductor restarted mid-batch, bad input."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from mooncaked.config import Config
from mooncaked.roles.conductor.batch.batches import BatchManager
from mooncaked.roles.conductor.role import ConductorRole
from tests.roles.cluster_fixtures import running_roles
from tests.roles.test_conductor_flow import make_config, url

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def batch_config(tmp_path: Path, **conductor: Any) -> Config:
    return make_config(tmp_path, conductor={"batch_dir": str(tmp_path / "batches"), **conductor})


def client(config: Config) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url(config, "/v1"), api_key="unused", max_retries=0)


def chat_line(custom_id: str, text: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     **GREEDY, **extra}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


async def until_status(api: openai.AsyncOpenAI, batch_id: str, statuses: set[str], timeout_s: float = 90.0,
                       min_completed: int = 0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await api.batches.retrieve(batch_id)
        if batch.status in statuses and batch.request_counts.completed >= min_completed:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch.request_counts}"
        await asyncio.sleep(0.1)


async def read_lines(api: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    content = await api.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def test_a_batch_runs_end_to_end_with_output_and_error_files(tmp_path: Path) -> None:
    config = batch_config(tmp_path)
    lines = [chat_line("a", "hello there"), b"{not json", chat_line("b", "what is two plus two", priority=-1),
             chat_line("c", "tell me"), {**chat_line("d", "x"), "url": "/v1/embeddings"}, chat_line("e", "last one")]
    async with running_roles(config, ["s0", "p0", "d0", "c0"]):
        api = client(config)
        uploaded = await api.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
        assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(jsonl(lines)), "input.jsonl")
        created = await api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h", metadata={"job": "nightly"})
        assert created.status in ("validating", "in_progress") and created.metadata == {"job": "nightly"}
        batch = await until_status(api, created.id, {"completed"})
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 4, 2)
        assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
        outputs = await read_lines(api, batch.output_file_id)
        assert [o["custom_id"] for o in outputs] == ["a", "b", "c", "e"]
        interactive = await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "tell me"}],
                                                         max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
        answer = outputs[2]["response"]
        assert answer["status_code"] == 200 and outputs[2]["error"] is None
        assert answer["body"]["choices"][0]["message"]["content"] == interactive.choices[0].message.content
        assert answer["body"]["usage"]["completion_tokens"] == 4
        errors = await read_lines(api, batch.error_file_id)
        assert [(e["error"]["line"], e["error"]["code"], e["custom_id"]) for e in errors] == [
            (2, "invalid_json", None), (5, "invalid_request", "d")]
        assert errors[1]["error"]["param"] == "url" and errors[0]["response"] is None
        listing = await api.batches.list()
        assert [b.id for b in listing.data] == [created.id]
        async with aiohttp.ClientSession() as http, http.get(url(config, "/metrics")) as response:
            metrics = await response.text()
        assert 'mooncaked_class_requests_total{request_class="batch",status="ok"} 4.0' in metrics
        assert 'mooncaked_class_requests_total{request_class="interactive",status="ok"} 1.0' in metrics
        assert (await api.files.delete(uploaded.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await api.files.retrieve(uploaded.id)
        await api.close()


async def test_cancel_keeps_what_was_answered(tmp_path: Path) -> None:
    config = batch_config(tmp_path, batch_max_in_flight=1)
    lines = [chat_line(f"line-{i}", f"count to {i}", max_tokens=24) for i in range(30)]
    async with running_roles(config, ["s0", "p0", "d0", "c0"]):
        api = client(config)
        uploaded = await api.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
        created = await api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
        await until_status(api, created.id, {"in_progress"}, min_completed=1)
        cancelling = await api.batches.cancel(created.id)
        assert cancelling.status in ("cancelling", "cancelled")
        batch = await until_status(api, created.id, {"cancelled"})
        assert batch.cancelled_at and 1 <= batch.request_counts.completed < 30
        outputs = await read_lines(api, batch.output_file_id)
        assert len(outputs) == batch.request_counts.completed and batch.error_file_id is None
        await api.close()


async def test_a_restarted_conductor_finishes_the_batch_answering_every_line_once(tmp_path: Path) -> None:
    config = batch_config(tmp_path, batch_max_in_flight=2)
    lines = [chat_line(f"r{i}", f"restart {i}", max_tokens=12) for i in range(14)]
    async with running_roles(config, ["s0", "p0", "d0"]):
        async with running_roles(config, ["c0"]):
            api = client(config)
            uploaded = await api.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
            created = await api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h")
            await until_status(api, created.id, {"in_progress"}, min_completed=3)
            await api.close()
        journal = tmp_path / "batches" / "batches" / created.id / "journal.jsonl"
        answered_before = [json.loads(line)["line"] for line in journal.read_text().splitlines()]
        assert 3 <= len(answered_before) < 14
        with open(journal, "ab") as torn:  # a conductor killed while appending leaves a torn last line
            torn.write(b'{"line": 99, "ok": tr')
        async with running_roles(config, ["c0"]):
            api = client(config)
            batch = await until_status(api, created.id, {"completed"})
            assert (batch.request_counts.completed, batch.request_counts.failed) == (14, 0)
            outputs = await read_lines(api, batch.output_file_id)
            await api.close()
    assert Counter(o["custom_id"] for o in outputs) == Counter(f"r{i}" for i in range(14))
    answered = [json.loads(line)["line"] for line in journal.read_text().splitlines()]
    assert answered[: len(answered_before)] == answered_before and sorted(answered) == list(range(1, 15))


async def test_bad_uploads_and_unknown_ids_get_openai_errors(tmp_path: Path) -> None:
    config = batch_config(tmp_path, max_file_bytes=4096)
    async with running_roles(config, ["s0", "d0", "c0"]) as roles:
        conductor = roles["c0"]
        assert isinstance(conductor, ConductorRole) and conductor.backend is not None and conductor.view is not None
        second = BatchManager(config, conductor.backend, conductor.view, tmp_path / "batches")
        with pytest.raises(RuntimeError, match="in use by another conductor"):
            await second.start()
        api = client(config)
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await api.files.create(file=("x.jsonl", jsonl([chat_line("a", "x")])), purpose="fine-tune")
        with pytest.raises(openai.APIStatusError) as too_large:
            await api.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
        assert too_large.value.status_code == 413 and "conductor.max_file_bytes" in too_large.value.message
        assert not list((tmp_path / "batches" / "files").glob("*"))  # nothing of the refused uploads is left
        with pytest.raises(openai.NotFoundError):
            await api.batches.retrieve("batch_" + "0" * 32)
        with pytest.raises(openai.NotFoundError):
            await api.batches.create(input_file_id="file-nothere", endpoint="/v1/completions",
                                     completion_window="24h")
        empty = await api.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            await api.batches.create(input_file_id=empty.id, endpoint="/v1/embeddings",  # type: ignore[arg-type]
                                     completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            await api.batches.create(input_file_id=empty.id, endpoint="/v1/completions",
                                     completion_window="1h")  # type: ignore[arg-type]
        created = await api.batches.create(input_file_id=empty.id, endpoint="/v1/completions",
                                           completion_window="24h")
        failed = await until_status(api, created.id, {"failed"})
        assert failed.errors is not None and failed.errors.data and failed.errors.data[0].code == "empty_file"
        await api.close()
