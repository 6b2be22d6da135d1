"""Queue order by class and priority, and when a batch line may start (sched/priority.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncaked.sched.priority import BatchGate, batch_admission, queue_rank
from mooncaked.sched.types import Placement, PolicyConfig, Rejection

POLICY = PolicyConfig(ttft_slo_s=2.0, tbt_slo_s=0.2)
GATE = BatchGate(max_in_flight=2, margin=0.5, backoff_s=3.0)


def placement(ttft_s: float, tbt_s: float) -> Placement:
    return Placement("r", "p0", "d0", 0, 0, None, 0, 0.0, 0.0, ttft_s, ttft_s, tbt_s)


@given(st.lists(st.tuples(st.booleans(), st.integers(-5, 5), st.floats(0, 100)), max_size=30))
def test_interactive_first_then_priority_then_arrival(entries: list[tuple[bool, int, float]]) -> None:
    ordered = sorted(entries, key=lambda e: queue_rank(*e))
    classes = [is_batch for is_batch, _, _ in ordered]
    assert classes == sorted(classes)  # every interactive request before every batch line
    for earlier, later in zip(ordered, ordered[1:]):
        if earlier[0] == later[0]:
            assert (earlier[1], earlier[2]) <= (later[1], later[2])


def test_a_batch_line_starts_only_with_headroom() -> None:
    assert batch_admission(placement(0.9, 0.09), 1, None, GATE, POLICY, now=10.0) == ""
    assert "batch_max_in_flight" in batch_admission(placement(0.1, 0.01), 2, None, GATE, POLICY, now=10.0)
    assert "TTFT" in batch_admission(placement(1.1, 0.01), 0, None, GATE, POLICY, now=10.0)
    assert "TBT" in batch_admission(placement(0.1, 0.11), 0, None, GATE, POLICY, now=10.0)
    assert "ttft_slo" in batch_admission(Rejection("r", "ttft_slo"), 0, None, GATE, POLICY, now=10.0)


def test_batch_work_yields_after_an_interactive_rejection() -> None:
    assert "yields" in batch_admission(placement(0.1, 0.01), 0, 8.0, GATE, POLICY, now=10.0)
    assert batch_admission(placement(0.1, 0.01), 0, 7.0, GATE, POLICY, now=10.0) == ""
