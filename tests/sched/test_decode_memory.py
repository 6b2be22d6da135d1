"""The decode-memory forecast (sched/decode_memory.py): peaks over a hold's life, against a brute-force scan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncaked.sched.decode_memory import (DecodeHold, decode_num_pages, earliest_fit, forecast_refusal, is_decoding,
                                           num_pages_for, peak_use)


def test_pages_cover_the_prompt_and_every_token_it_may_generate() -> None:
    assert num_pages_for(100, 28, 64) == 2 and num_pages_for(100, 29, 64) == 3


@given(num_prompt_tokens=st.integers(1, 500), max_tokens=st.integers(1, 500), block_size=st.sampled_from([1, 16, 64]),
       num_sequences=st.integers(1, 8))
def test_parallel_sequences_hold_the_full_prompt_blocks_once_and_each_its_own_tail_and_output(
        num_prompt_tokens: int, max_tokens: int, block_size: int, num_sequences: int) -> None:
    alone = num_pages_for(num_prompt_tokens, max_tokens, block_size)
    together = num_pages_for(num_prompt_tokens, max_tokens, block_size, num_sequences)
    num_shared = num_prompt_tokens // block_size
    assert together == num_shared + (alone - num_shared) * num_sequences <= alone * num_sequences


@given(num_prompt_tokens=st.integers(1, 500), max_tokens=st.integers(0, 500), block_size=st.sampled_from([1, 16, 64]),
       num_sequences=st.integers(1, 8), is_inline_prefill=st.booleans())
def test_only_a_request_its_prefill_first_token_ends_takes_no_decode_pages(
        num_prompt_tokens: int, max_tokens: int, block_size: int, num_sequences: int, is_inline_prefill: bool) -> None:
    pages = decode_num_pages(num_prompt_tokens, max_tokens, block_size, num_sequences,
                             is_inline_prefill=is_inline_prefill)
    if max_tokens == 1 and not is_inline_prefill:  # the prefill's first token is all of it: nothing decodes
        assert not is_decoding(max_tokens, is_inline_prefill) and pages == 0
    else:  # an inline prefill computes its prompt into the decode instance's pages; max_tokens 0 is unknown
        assert is_decoding(max_tokens, is_inline_prefill)
        assert pages == num_pages_for(num_prompt_tokens, max_tokens, block_size, num_sequences) > 0


def test_a_sequence_predicted_to_end_before_the_decode_start_leaves_room() -> None:
    running = [DecodeHold(6, 0.0, 5.0), DecodeHold(2, 0.0, 50.0)]
    assert forecast_refusal(DecodeHold(4, 6.0, 20.0), running, 8, 32) == ""
    assert forecast_refusal(DecodeHold(4, 1.0, 20.0), running, 8, 32).startswith("memory: needs 4 KV pages")
    # a placed request starting later inside the new one's life counts too
    placed = [*running, DecodeHold(5, 10.0, 30.0)]
    assert forecast_refusal(DecodeHold(4, 6.0, 20.0), placed, 8, 32).startswith("memory")
    assert forecast_refusal(DecodeHold(4, 6.0, 9.0), placed, 8, 32) == ""
    assert forecast_refusal(DecodeHold(1, 6.0, 20.0), running, 100, 1).startswith("batch")


HOLDS = st.lists(st.builds(lambda p, s, d: DecodeHold(p, float(s), float(s + d)), st.integers(0, 20),
                           st.integers(0, 50), st.integers(1, 50)), max_size=12)


@given(holds=HOLDS, start=st.integers(0, 60), duration=st.integers(1, 60), pages=st.integers(0, 30),
       num_pages=st.integers(0, 120), max_num_seqs=st.integers(1, 14))
def test_the_forecast_refuses_exactly_when_some_moment_of_the_new_hold_overflows(
        holds: list[DecodeHold], start: int, duration: int, pages: int, num_pages: int, max_num_seqs: int) -> None:
    new = DecodeHold(pages, float(start), float(start + duration))
    # integer times: scanning every integer instant of the new hold's life finds every peak
    moments = [[h for h in holds if h.is_held_at(float(t))] for t in range(start, start + duration)]
    is_over = any(sum(h.num_pages for h in m) + pages > num_pages or len(m) + 1 > max_num_seqs for m in moments)
    assert bool(forecast_refusal(new, holds, num_pages, max_num_seqs)) == is_over
    peak_pages, peak_seqs = peak_use(holds, float(start), float(start + duration))
    assert peak_pages == max(sum(h.num_pages for h in m) for m in moments)
    assert peak_seqs == max(len(m) for m in moments)


def test_the_conductor_the_decode_role_and_the_simulator_forecast_with_this_rule() -> None:
    from mooncaked.roles.worker.decode import admission as decode_admission
    from mooncaked.sched import admission
    from mooncaked.sim import decode_reserve

    assert admission.forecast_refusal is forecast_refusal  # select_decode's room, which the conductor runs
    assert decode_admission.forecast_refusal is forecast_refusal and decode_reserve.forecast_refusal is forecast_refusal


@given(holds=HOLDS, start=st.integers(0, 60), duration=st.integers(1, 60), pages=st.integers(0, 30),
       num_pages=st.integers(0, 120), max_num_seqs=st.integers(1, 14), slack=st.integers(0, 80))
def test_the_earliest_fit_is_the_first_integer_start_at_which_the_moved_hold_fits(
        holds: list[DecodeHold], start: int, duration: int, pages: int, num_pages: int, max_num_seqs: int,
        slack: int) -> None:
    new = DecodeHold(pages, float(start), float(start + duration))
    fit = earliest_fit(new, holds, num_pages, max_num_seqs, float(start + slack))
    # integer hold ends: a brute-force scan of every integer start in the window finds the same first one
    fits = [t for t in range(start, start + slack + 1)
            if not forecast_refusal(DecodeHold(pages, float(t), float(t + duration)), holds, num_pages, max_num_seqs)]
    assert fit == (float(fits[0]) if fits else None)


def test_a_request_that_fits_only_later_is_given_the_end_of_the_hold_that_frees_its_pages() -> None:
    running = [DecodeHold(6, 0.0, 5.0), DecodeHold(2, 0.0, 50.0)]
    assert earliest_fit(DecodeHold(4, 1.0, 20.0), running, 8, 32, latest_start=30.0) == 5.0
    assert earliest_fit(DecodeHold(4, 1.0, 20.0), running, 8, 32, latest_start=4.0) is None
    assert earliest_fit(DecodeHold(4, 6.0, 20.0), running, 8, 32, latest_start=6.0) == 6.0
