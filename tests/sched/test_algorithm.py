"""Algorithm 1 on hand-built clusters; every expected answer is worked out in the comments."""

from typing import Any

import pytest

from mooncaked.sched.algorithm import SchedulerPolicy, schedule
from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import (
    DecodeInstanceView,
    Placement,
    PolicyConfig,
    PrefillInstanceView,
    Rejection,
    RequestInfo,
)

# Prefill: 1 s per 1000 new tokens (coefficients on (1, n, p, n^2, np, p^2), n and p in thousands).
PREFILL = PrefillTimePredictor((0.0, 1.0, -1.0, 0.0, 0.0, 0.0))
# Decode step: 10 ms + 1 ms per 1000 context tokens.
DECODE = DecodeStepPredictor((0.010, 0.0, 0.001))
KEYS = tuple(f"k{i}" for i in range(10))
REQUEST = RequestInfo("r1", num_prompt_tokens=10_000, block_keys=KEYS)  # 10 blocks of 1000 tokens


def _policy(seconds_per_block: float, **config: Any) -> SchedulerPolicy:
    transfer = TransferTimePredictor(bytes_per_block=1, bandwidth=1.0 / seconds_per_block)
    base: dict[str, Any] = dict(block_size=1000, ttft_slo_s=30.0, tbt_slo_s=0.1, kvcache_balancing_threshold=1.2)
    base.update(config)
    return SchedulerPolicy(PolicyConfig(**base), Predictors(PREFILL, DECODE, transfer))


def _index(holdings: dict[str, int]) -> ShadowIndex:
    index = ShadowIndex()
    for store, num_blocks in holdings.items():
        index.apply_dump(store, 0, KEYS[:num_blocks])
    return index


def _decode(instance: str, num_running: int = 0, tokens: int = 0) -> DecodeInstanceView:
    return DecodeInstanceView(instance, f"s-{instance}", num_running, tokens, 64, 1_000_000)


# pA holds 8 blocks but has 10 s of queue; pB is idle with nothing cached.
PREFILLS = [PrefillInstanceView("pA", "sA", queued_prefill_s=10.0), PrefillInstanceView("pB", "sB")]
DECODES = [_decode("d0", 4, 40_000), _decode("d1", 1, 10_000)]


def test_remote_prefix_worth_fetching() -> None:
    # pA: local 8 = best 8 -> no fetch; 10 s queue + (10k - 8k) / 1k = 2 s prefill -> TTFT 12 s.
    # pB: 8 > 1.2 * 0 -> fetch 8 blocks at 0.25 s = 2 s, no queue, 2 s prefill -> TTFT 4 s. pB wins.
    decision = schedule(REQUEST, PREFILLS, DECODES, _index({"sA": 8}), _policy(0.25), now=0.0)
    assert isinstance(decision, Placement)
    assert decision.prefill_instance == "pB"
    assert decision.fetch_from_store == "sA" and decision.num_fetch_blocks == 8
    assert decision.num_prefix_blocks == 8 and decision.num_local_prefix_blocks == 0
    assert decision.predicted_ttft_s == pytest.approx(4.0)
    # d1 has the lighter batch: 10 ms + (10k + 10k) / 1k * 1 ms = 30 ms (d0: 10 + 50 = 60 ms).
    assert decision.decode_instance == "d1" and decision.predicted_tbt_s == pytest.approx(0.030)


def test_an_excluded_store_is_no_source_and_no_local_prefix() -> None:
    # sA failed to deliver the prefix: pB computes all 10k tokens (10 s); pA has no local prefix either and
    # queues 10 s first. pB wins with no fetch.
    decision = schedule(REQUEST, PREFILLS, DECODES, _index({"sA": 8}), _policy(0.25), now=0.0,
                        excluded_stores=frozenset({"sA"}))
    assert isinstance(decision, Placement) and decision.prefill_instance == "pB"
    assert decision.fetch_from_store is None and decision.num_prefix_blocks == 0
    assert decision.predicted_ttft_s == pytest.approx(10.0)


def test_remote_prefix_not_worth_fetching() -> None:
    # At 2 s per block the fetch costs 16 s: pB = 16 + 0 + 2 = 18 s; pA = 12 s wins, nothing fetched.
    # (Algorithm 1 never considers pB recomputing from scratch, 10 s, once the ratio exceeds the threshold.)
    decision = schedule(REQUEST, PREFILLS, DECODES, _index({"sA": 8}), _policy(2.0), now=0.0)
    assert isinstance(decision, Placement)
    assert decision.prefill_instance == "pA" and decision.fetch_from_store is None
    assert decision.predicted_ttft_s == pytest.approx(12.0)


def test_a_measured_slow_link_sends_the_prompt_where_the_prefix_is() -> None:
    # At the configured 0.25 s per block pB fetches (4 s, test above). pB measured sA's link at a tenth of that:
    # 8 blocks at 2.5 s = 20 s + 2 s = 22 s, or recompute all 10 blocks: 10 s; pA = 7 s queue + 2 s = 9 s wins,
    # nothing crosses the slow link.
    slow = [PrefillInstanceView("pA", "sA", queued_prefill_s=7.0),
            PrefillInstanceView("pB", "sB", fetch_bandwidth=(("sA", 0.4),))]
    decision = schedule(REQUEST, slow, DECODES, _index({"sA": 8}), _policy(0.25), now=0.0)
    assert isinstance(decision, Placement)
    assert decision.prefill_instance == "pA" and decision.fetch_from_store is None
    assert decision.predicted_ttft_s == pytest.approx(9.0)


def test_a_measured_slow_link_is_recomputed_when_that_is_faster() -> None:
    # The paper's line 5 has pB fetch over the slow link (22 s) and so loses to pA (10 s queue + 2 s = 12 s);
    # pB recomputing its 10 blocks takes 10 s and wins (sched/prefix_plans.py).
    slow = [PREFILLS[0], PrefillInstanceView("pB", "sB", fetch_bandwidth=(("sA", 0.4),))]
    decision = schedule(REQUEST, slow, DECODES, _index({"sA": 8}), _policy(0.25), now=0.0)
    assert isinstance(decision, Placement)
    assert decision.prefill_instance == "pB" and decision.fetch_from_store is None
    assert decision.num_prefix_blocks == 0 and decision.predicted_transfer_s == 0.0
    assert decision.predicted_ttft_s == pytest.approx(10.0)


def test_queue_outweighs_cache() -> None:
    # cache_aware (local prefixes only): pA = 20 s queue + 2 s = 22 s; pB = 0 + 10 s from scratch = 10 s.
    prefills = [PrefillInstanceView("pA", "sA", queued_prefill_s=20.0), PrefillInstanceView("pB", "sB")]
    decision = schedule(REQUEST, prefills, DECODES, _index({"sA": 8}), _policy(0.25, scheduler="cache_aware"), 0.0)
    assert isinstance(decision, Placement)
    assert decision.prefill_instance == "pB" and decision.num_prefix_blocks == 0
    assert decision.predicted_ttft_s == pytest.approx(10.0)


def test_queue_time_counts_the_running_prefill() -> None:
    # pA busy until t=105 (5 s left at now=100) plus 1 s queued -> T_queue 6 s; 6 + 2 = 8 s beats pB's 10 s.
    prefills = [PrefillInstanceView("pA", "sA", busy_until=105.0, queued_prefill_s=1.0), PrefillInstanceView("pB", "sB")]
    decision = schedule(REQUEST, prefills, DECODES, _index({"sA": 8}), _policy(5.0), now=100.0)
    assert isinstance(decision, Placement)
    assert decision.prefill_instance == "pA" and decision.predicted_queue_s == pytest.approx(6.0)


def test_balancing_threshold_edge() -> None:
    # pB holds 5, sC holds 6: 6 > 1.2 * 5 is false -> pB keeps its local 5 (prefill 5 s).
    prefills = [PrefillInstanceView("pB", "sB")]
    decision = schedule(REQUEST, prefills, DECODES, _index({"sB": 5, "sC": 6}), _policy(0.1), 0.0)
    assert isinstance(decision, Placement) and decision.fetch_from_store is None
    # sC holds 7: 7 > 6 -> fetch 2 blocks (0.2 s) and prefill 3 s.
    decision = schedule(REQUEST, prefills, DECODES, _index({"sB": 5, "sC": 7}), _policy(0.1), 0.0)
    assert isinstance(decision, Placement)
    assert decision.fetch_from_store == "sC" and decision.num_fetch_blocks == 2
    assert decision.predicted_ttft_s == pytest.approx(3.2)


def test_rejection_at_the_ttft_slo_edge() -> None:
    index = _index({"sA": 8})
    accepted = schedule(REQUEST, PREFILLS, DECODES, index, _policy(0.25, ttft_slo_s=4.0), 0.0)
    assert isinstance(accepted, Placement)  # TTFT 4.0 is not above the SLO
    rejected = schedule(REQUEST, PREFILLS, DECODES, index, _policy(0.25, ttft_slo_s=3.99), 0.0)
    assert isinstance(rejected, Rejection) and rejected.reason == "ttft_slo"
    assert rejected.predicted_ttft_s == pytest.approx(4.0)


def test_rejection_at_the_tbt_slo_edge() -> None:
    # Best decode TBT is 30 ms (d1). SLO 30 ms accepts; 29 ms rejects under early rejection.
    index = _index({"sA": 8})
    assert isinstance(schedule(REQUEST, PREFILLS, DECODES, index, _policy(0.25, tbt_slo_s=0.030), 0.0), Placement)
    rejected = schedule(REQUEST, PREFILLS, DECODES, index, _policy(0.25, tbt_slo_s=0.029), 0.0)
    assert isinstance(rejected, Rejection) and rejected.reason == "tbt_slo"


def test_baselines() -> None:
    index = _index({"sA": 8})
    lb = schedule(REQUEST, PREFILLS, DECODES, index, _policy(0.25, scheduler="load_balancing"), 0.0)
    assert isinstance(lb, Placement) and lb.prefill_instance == "pB" and lb.fetch_from_store is None
    picks = set()
    for i in range(40):
        request = RequestInfo(f"r{i}", 10_000, KEYS)
        decision = schedule(request, PREFILLS, DECODES, index, _policy(0.25, scheduler="random"), 0.0)
        assert isinstance(decision, Placement)
        picks.add(decision.prefill_instance)
        again = schedule(request, PREFILLS, DECODES, index, _policy(0.25, scheduler="random"), 0.0)
        assert isinstance(again, Placement) and again.prefill_instance == decision.prefill_instance
    assert picks == {"pA", "pB"}


def test_no_instances() -> None:
    index = _index({})
    unavailable = [PrefillInstanceView("pA", "sA", is_available=False)]
    no_prefill = schedule(REQUEST, unavailable, DECODES, index, _policy(1.0), 0.0)
    assert isinstance(no_prefill, Rejection) and no_prefill.reason == "no_prefill_instance"
    no_decode = schedule(REQUEST, PREFILLS, [], index, _policy(1.0), 0.0)
    assert isinstance(no_decode, Rejection) and no_decode.reason == "no_decode_instance"


def test_ties_go_to_the_first_or_to_the_coldest_store() -> None:
    # Three idle instances, nothing cached: every TTFT is 10 s. The paper takes the first; `coldest_store` takes
    # the one whose store's least recently used block was used longest ago (pC: at t=5; pA at t=50).
    views = [PrefillInstanceView("pA", "sA", coldest_use=50.0), PrefillInstanceView("pB", "sB", coldest_use=20.0),
             PrefillInstanceView("pC", "sC", coldest_use=5.0)]
    first = schedule(REQUEST, views, DECODES, _index({}), _policy(0.25), now=100.0)
    coldest = schedule(REQUEST, views, DECODES, _index({}), _policy(0.25, tie_break="coldest_store"), now=100.0)
    assert isinstance(first, Placement) and first.prefill_instance == "pA"
    assert isinstance(coldest, Placement) and coldest.prefill_instance == "pC"
    # A faster instance still wins over a colder one: pA holds 8 blocks (TTFT 2 s).
    warm = schedule(REQUEST, views, DECODES, _index({"sA": 8}), _policy(0.25, tie_break="coldest_store"), now=100.0)
    assert isinstance(warm, Placement) and warm.prefill_instance == "pA"
    with pytest.raises(ValueError, match="tie_break"):
        PolicyConfig(tie_break="random")


def test_the_device_tier_counts_in_the_local_prefix_and_wins_ties() -> None:
    # pA and pB share host store sS holding 6 blocks; pB's device prefix cache holds 6 too: equal TTFTs
    # (4 s of prefill each), pB wins as the one reading them in place.
    views = [PrefillInstanceView("pA", "sS", device_id="pA"), PrefillInstanceView("pB", "sS", device_id="pB")]
    devices = _index({"pB": 6})
    decision = schedule(REQUEST, views, DECODES, _index({"sS": 6}), _policy(0.25), now=0.0, device_index=devices)
    assert isinstance(decision, Placement) and decision.prefill_instance == "pB"
    assert decision.num_local_prefix_blocks == 6 and decision.fetch_from_store is None
    # Without the device index the tie goes to the first.
    decision = schedule(REQUEST, views, DECODES, _index({"sS": 6}), _policy(0.25), now=0.0)
    assert isinstance(decision, Placement) and decision.prefill_instance == "pA"
    # The store evicted them but pB's device tier still holds 9: pB's local prefix is 9 (1 s of prefill), pA's 0
    # (10 s; a device tier is no store to fetch from) -> pB, nothing fetched.
    decision = schedule(REQUEST, views, DECODES, ShadowIndex(), _policy(0.25), now=0.0,
                        device_index=_index({"pB": 9}))
    assert isinstance(decision, Placement) and decision.prefill_instance == "pB"
    assert decision.num_prefix_blocks == 9 and decision.predicted_ttft_s == pytest.approx(1.0)
