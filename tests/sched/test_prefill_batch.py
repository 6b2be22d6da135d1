"""Which queued prefills the next forward takes (sched/prefill_batch.py), and that the prefill role and the
simulator both run this rule."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from mooncaked.sched.prefill_batch import take_batch
from mooncaked.sched.priority import queue_rank


@dataclass
class Job:
    name: str
    num_new_tokens: int
    is_batch: bool = False
    priority: int = 0
    enqueued_at: float = 0.0


def test_jobs_run_by_class_priority_and_arrival_within_the_token_budget() -> None:
    queue = [Job("late", 100, enqueued_at=3.0), Job("line", 100, is_batch=True, enqueued_at=0.0),
             Job("urgent", 100, priority=-1, enqueued_at=5.0), Job("early", 100, enqueued_at=1.0)]
    assert [j.name for j in take_batch(queue, 250, 1024, is_one_at_a_time=False)] == ["urgent", "early"]
    assert [j.name for j in take_batch(queue, 250, 1024, is_one_at_a_time=False)] == ["late"]  # no batch line
    assert [j.name for j in take_batch(queue, 250, 1024, is_one_at_a_time=False)] == ["line"]
    assert queue == []


def test_a_long_prompt_runs_alone_and_a_group_takes_one_prompt() -> None:
    queue = [Job("short", 10, enqueued_at=0.0), Job("long", 2000, enqueued_at=1.0), Job("next", 10, enqueued_at=2.0)]
    assert [j.name for j in take_batch(queue, 4096, 1024, is_one_at_a_time=False)] == ["short"]
    assert [j.name for j in take_batch(queue, 4096, 1024, is_one_at_a_time=False)] == ["long"]
    queue = [Job("a", 10, enqueued_at=0.0), Job("b", 10, enqueued_at=1.0)]
    assert [j.name for j in take_batch(queue, 4096, 1024, is_one_at_a_time=True)] == ["a"]


JOBS = st.lists(st.builds(Job, st.text(max_size=3), st.integers(1, 3000), st.booleans(), st.integers(-2, 2),
                          st.floats(0, 100)), max_size=12)


@given(queue=JOBS, max_batch_tokens=st.integers(16, 4096), prefill_chunk=st.integers(16, 2048),
       is_one_at_a_time=st.booleans())
def test_a_batch_is_the_head_of_the_queue_order_and_keeps_every_limit(queue: list[Job], max_batch_tokens: int,
                                                                      prefill_chunk: int,
                                                                      is_one_at_a_time: bool) -> None:
    ordered = sorted(queue, key=lambda j: queue_rank(j.is_batch, j.priority, j.enqueued_at))
    before = list(queue)
    batch = take_batch(queue, max_batch_tokens, prefill_chunk, is_one_at_a_time=is_one_at_a_time)
    assert batch == ordered[:len(batch)] and (batch or not before)
    assert sorted(map(id, queue + batch)) == sorted(map(id, before))
    if len(batch) > 1:
        assert not is_one_at_a_time
        assert sum(j.num_new_tokens for j in batch) <= max_batch_tokens
        assert all(j.num_new_tokens <= prefill_chunk for j in batch)
        assert len({j.is_batch for j in batch}) == 1


def test_the_prefill_role_and_the_simulator_call_this_rule() -> None:
    from mooncaked.roles.worker.prefill import role
    from mooncaked.sim import prefill_side

    assert role.take_batch is take_batch and prefill_side.take_batch is take_batch
