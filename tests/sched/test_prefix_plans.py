"""Algorithm 1 with a slow link: the fast path or recompute, never worse than the paper's line 5, and the paper's
placement wherever no link is measured slow."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncaked.sched.algorithm import PrefillChoice, SchedulerPolicy, choose_prefill, prefill_model, schedule
from mooncaked.sched.predictors import queue_time_s
from mooncaked.sched.prefix_plans import PrefixPlan, best_prefix, prefix_plans
from mooncaked.sched.types import Placement, PrefillInstanceView, RequestInfo
from tests.sched.test_algorithm import DECODES, REQUEST, _index, _policy

STORES = ("sA", "sB", "sC")


def test_a_slow_link_takes_a_shorter_prefix_over_a_fast_one() -> None:
    # pB measured sA at 0.4 B/s (2.5 s per block): the paper fetches sA's 8 blocks, 20 s + 2 s of prefill = 22 s.
    # sC holds 6 over an unmeasured (configured, 0.25 s per block) link: 1.5 s + 4 s = 5.5 s; recompute: 10 s.
    views = [PrefillInstanceView("pB", "sB", fetch_bandwidth=(("sA", 0.4),))]
    decision = schedule(REQUEST, views, DECODES, _index({"sA": 8, "sC": 6}), _policy(0.25), now=0.0)
    assert isinstance(decision, Placement)
    assert decision.fetch_from_store == "sC" and decision.num_fetch_blocks == 6
    assert decision.predicted_transfer_s == pytest.approx(1.5) and decision.predicted_ttft_s == pytest.approx(5.5)


def test_no_slow_link_keeps_the_papers_fetch() -> None:
    # Configured 2 s per block; pB measured sA faster (1.6 s): no slow link, so line 5 stands and pB fetches the
    # 8 blocks (12.8 s + 2 s) though recomputing would take 10 s (tests/sched/test_algorithm.py has the same
    # with pA's queue deciding).
    (plan,) = prefix_plans(0, {"sA": 8}, {"sA": 0.625}, 1.2, _policy(2.0).predictors.transfer)
    assert (plan.num_prefix_blocks, plan.source, plan.transfer_s) == (8, "sA", pytest.approx(12.8))
    assert prefix_plans(0, {"sA": 8}, {}, 1.2, _policy(2.0).predictors.transfer) == [PrefixPlan(8, "sA", 16.0)]


def test_a_slow_link_adds_the_other_stores_longest_first_then_recompute() -> None:
    transfer = _policy(0.25).predictors.transfer
    plans = prefix_plans(2, {"sA": 9, "sB": 3, "sC": 5, "sD": 2}, {"sA": 1.0, "sC": 8.0}, 1.2, transfer)
    # sB's 3 passes 1.2 x 2; sD's 2 does not
    assert [(p.source, p.num_prefix_blocks) for p in plans] == [("sA", 9), ("sC", 5), ("sB", 3), (None, 2)]
    assert plans[0].transfer_s == pytest.approx(7.0) and plans[1].transfer_s == pytest.approx(0.375)
    assert best_prefix({}) == (None, 0) and best_prefix({"sA": 3, "sB": 3}) == ("sA", 3)


def _papers_choice(request: RequestInfo, views: list[PrefillInstanceView], lengths: dict[str, int],
                   policy: SchedulerPolicy) -> PrefillChoice:
    """Line 5 as the paper writes it: fetch the longest prefix whenever it passes the threshold."""
    best_store, best_len = best_prefix(lengths)
    best: PrefillChoice | None = None
    for view in views:
        local_len = lengths.get(view.store_id, 0)
        if best_len > policy.config.kvcache_balancing_threshold * local_len:
            bandwidth = dict(view.fetch_bandwidth).get(best_store or "", 0.0)
            prefix_len, source = best_len, best_store
            transfer_s = policy.predictors.transfer.predict(best_len - local_len, bandwidth)
        else:
            prefix_len, source, transfer_s = local_len, None, 0.0
        prefill_s = prefill_model(view, policy).predict(request.num_prompt_tokens,
                                                        min(prefix_len * 1000, request.num_prompt_tokens - 1))
        choice = PrefillChoice(view, prefix_len, local_len, source, transfer_s, queue_time_s(view, 0.0), prefill_s)
        if best is None or choice.ttft_s < best.ttft_s:
            best = choice
    assert best is not None
    return best


_RATES = st.sampled_from([0.0, 0.4, 1.0, 4.0, 40.0])  # bytes per second; 0: never measured (configured 4)


@given(holdings=st.fixed_dictionaries({store: st.integers(0, 10) for store in STORES}),
       queues=st.lists(st.sampled_from([0.0, 1.0, 3.0, 10.0]), min_size=1, max_size=3),
       rates=st.lists(st.tuples(_RATES, _RATES, _RATES), min_size=3, max_size=3))
def test_never_slower_than_the_paper_and_the_same_with_no_slow_link(
        holdings: dict[str, int], queues: list[float], rates: list[tuple[float, float, float]]) -> None:
    policy = _policy(0.25)
    views = [PrefillInstanceView(f"p{i}", STORES[i], queued_prefill_s=queue,
                                 fetch_bandwidth=tuple((s, r) for s, r in zip(STORES, rates[i]) if r > 0))
             for i, queue in enumerate(queues)]
    lengths = {store: n for store, n in holdings.items() if n > 0}
    chosen = choose_prefill(REQUEST, views, lengths, policy, 0.0)
    papers = _papers_choice(REQUEST, views, lengths, policy)
    assert chosen.ttft_s <= papers.ttft_s + 1e-9
    is_any_slow = any(0 < rate < policy.predictors.transfer.bandwidth for view in views
                      for _, rate in view.fetch_bandwidth)
    if not is_any_slow:
        assert (chosen.view.instance_id, chosen.fetch_from_store, chosen.num_prefix_blocks) == \
            (papers.view.instance_id, papers.fetch_from_store, papers.num_prefix_blocks)
        assert chosen.ttft_s == papers.ttft_s
