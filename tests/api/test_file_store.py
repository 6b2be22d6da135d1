"""Batch API files on disk: bounded streamed uploads, owners, ids that cannot leave the directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncaked.api.errors import ApiError
from mooncaked.api.file_store import FileStore


class Chunks:
    def __init__(self, data: bytes, size: int = 7) -> None:
        self.parts = [data[i:i + size] for i in range(0, len(data), size)]

    async def next_chunk(self, size: int) -> bytes:
        return self.parts.pop(0) if self.parts else b""


async def test_upload_commit_read_list_delete(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.start()
    file_id = store.new_id()
    assert await store.receive(Chunks(b"line one\nline two\n"), file_id, max_bytes=100) == 18
    info = store.commit_upload(file_id, "in.jsonl", "batch", "alice", 18)
    assert store.data_path(file_id, "alice").read_bytes() == b"line one\nline two\n"
    assert store.get(file_id, "alice") == info and info.as_json()["bytes"] == 18
    assert store.list("alice") == [info] and store.list("bob") == [] and store.list("alice", "batch_output") == []
    with pytest.raises(ApiError) as error:
        store.get(file_id, "bob")
    assert error.value.status == 404
    store.delete(file_id, "alice")
    assert not list(tmp_path.iterdir())


async def test_an_upload_over_the_bound_is_413_and_leaves_nothing(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.start()
    with pytest.raises(ApiError) as error:
        await store.receive(Chunks(b"x" * 101), store.new_id(), max_bytes=100)
    assert error.value.status == 413 and "conductor.max_file_bytes" in error.value.message
    assert not list(tmp_path.iterdir())


@given(st.text(max_size=40))
def test_any_file_id_is_a_404_or_a_file_of_the_store(tmp_path_factory: pytest.TempPathFactory, file_id: str) -> None:
    store = FileStore(tmp_path_factory.mktemp("files"))
    store.start()
    with pytest.raises(ApiError) as error:
        store.get(file_id, "alice")
    assert error.value.status == 404
