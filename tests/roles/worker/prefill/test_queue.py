"""A prefill instance's queue: interactive prompts before batch lines, then priority, then arrival, within the
batch token budget, batch lines never in an interactive prompt's forward (PrefillRole._take_batch)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mooncaked.roles.worker.messages import PrefillRequest, SamplingSpec
from mooncaked.roles.worker.prefill.queue import PrefillJob
from mooncaked.roles.worker.prefill.role import PrefillRole
from tests.roles.cluster_fixtures import cluster_config, instance


def job(name: str, num_tokens: int, arrival: float, *, is_batch: bool = False, priority: int = 0) -> PrefillJob:
    spec = SamplingSpec(max_tokens=1, priority=priority, is_batch=is_batch)
    plan: Any = SimpleNamespace(num_prefix_blocks=0, kv=SimpleNamespace(num_tokens=num_tokens,
                                                                        worker=SimpleNamespace(block_size=16)))
    return PrefillJob(PrefillRequest(name, [1] * num_tokens, [], spec), plan, arrival, arrival,
                      asyncio.get_running_loop().create_future())


async def test_batches_are_taken_by_class_priority_and_arrival(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("p0", "prefill")], worker={"max_batch_tokens": 256,
                                                                          "prefill_chunk": 128})
    role = PrefillRole(config, config.instance_named("p0"))
    role._queue = [job("batch-early", 100, 0.0, is_batch=True, priority=-5), job("low", 100, 1.0, priority=3),
                   job("urgent", 100, 2.0, priority=-1), job("normal", 100, 3.0), job("batch", 50, 4.0, is_batch=True)]
    taken = []
    while role._queue:
        taken.append([j.request.request_id for j in role._take_batch()])
    assert taken == [["urgent", "normal"], ["low"], ["batch-early", "batch"]]  # never mixed into interactive work
    await role.worker.stop()
