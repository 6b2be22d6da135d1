"""The P/D controller's pool loads from LOAD replies: a decode backlog waiting at RESERVE is decode demand only in
the share of batch slots that decoding sequences hold."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncaked.config import InstanceConfig
from mooncaked.roles.conductor.leader import decode_load
from mooncaked.roles.conductor.view.instances import WorkerState
from mooncaked.roles.worker.messages import LoadReply


def decode_state(num_running: int, num_waiting: int, num_prefilling: int, num_reserving: int,
                 max_batch_size: int = 4, step_time_s: float = 0.01) -> WorkerState:
    load = LoadReply(role="decode", num_running=num_running, num_waiting=num_waiting, num_queued_tokens=0,
                     num_free_pages=10, num_pages=10, step_time_s=step_time_s, num_prefilling=num_prefilling,
                     num_reserving=num_reserving)
    return WorkerState(InstanceConfig(name="d", role="decode"), "s", max_batch_size, 1000, load=load, is_up=True)


def test_a_backlog_behind_decoding_sequences_is_decode_load() -> None:
    # four sequences decode, six calls wait for a slot: 2.5 batches of demand
    assert decode_load(decode_state(4, 0, 0, 6), tbt_slo_s=1.0) == 2.5


def test_a_backlog_behind_prompts_in_prefill_is_not() -> None:
    # every slot is held by a reservation whose prompt is still prefilling: no decode work, however long the line
    assert decode_load(decode_state(0, 4, 4, 6), tbt_slo_s=1.0) == 0.0


def test_a_mixed_batch_counts_the_decoding_share() -> None:
    # 2 running + 1 ready reservation of 4 slots (one still prefilling): 3/4 of the 4 waiting calls count
    assert decode_load(decode_state(2, 2, 1, 4), tbt_slo_s=1.0) == (3 + 3) / 4


@given(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8), st.integers(0, 50), st.integers(1, 8))
def test_waiting_calls_never_lower_the_load_and_count_at_most_once(num_running: int, num_waiting: int,
                                                                    num_prefilling: int, num_reserving: int,
                                                                    max_batch_size: int) -> None:
    num_prefilling = min(num_prefilling, num_waiting)
    without = decode_load(decode_state(num_running, num_waiting, num_prefilling, 0, max_batch_size), 1.0)
    with_calls = decode_load(decode_state(num_running, num_waiting, num_prefilling, num_reserving, max_batch_size),
                             1.0)
    assert without <= with_calls <= without + num_reserving / max_batch_size + 1e-9
