"""Serving metric math on constructed timings."""

from __future__ import annotations

import pytest

from mooncaked.bench.stats import RequestResult, meets_slos, parse_goodput, summarize, tbt_s, tpot_s


def result(ttft_s: float, gaps_s: list[float], *, num_output_tokens: int | None = None,
           num_prompt_tokens: int = 10) -> RequestResult:
    return RequestResult(
        is_success=True, status=200, num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=len(gaps_s) + 1 if num_output_tokens is None else num_output_tokens,
        ttft_s=ttft_s, e2el_s=ttft_s + sum(gaps_s), chunk_gaps_s=gaps_s,
    )


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    assert tpot_s(result(0.5, [0.1, 0.3])) == pytest.approx(0.2)
    # usage counts 5 tokens delivered in 3 chunks: tpot uses tokens, not chunks
    assert tpot_s(result(0.5, [0.2, 0.2], num_output_tokens=5)) == pytest.approx(0.1)
    assert tpot_s(result(0.5, [], num_output_tokens=1)) is None


def test_tbt_is_mean_of_the_longest_tenth_of_gaps() -> None:
    gaps = [0.01] * 18 + [0.5, 0.3]
    assert tbt_s(gaps) == pytest.approx(0.4)  # 20 gaps -> the longest 2
    assert tbt_s([0.01, 0.02, 0.09]) == pytest.approx(0.09)  # at least one gap
    assert tbt_s([0.01] * 10 + [0.2]) == pytest.approx((0.2 + 0.01) / 2)  # ceil(1.1) = 2
    assert tbt_s([]) is None


def test_summary_on_constructed_timings() -> None:
    results = [
        result(0.1, [0.01, 0.01, 0.01]),  # 4 tokens, e2el 0.13
        result(0.3, [0.05, 0.05]),  # 3 tokens, e2el 0.4
        RequestResult(is_success=False, status=429, error="overloaded"),
        RequestResult(is_success=False, status=200, error="error event"),
        RequestResult(is_success=False, status=0, error="connection refused"),
    ]
    summary = summarize(results, duration_s=2.0, slos_ms={"ttft": 200, "tpot": 20})
    assert (summary["completed"], summary["rejected"], summary["failed"]) == (2, 1, 2)
    assert summary["total_input_tokens"] == 20 and summary["total_output_tokens"] == 7
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(3.5)
    assert summary["total_token_throughput"] == pytest.approx(13.5)
    assert summary["request_goodput"] == pytest.approx(0.5)  # only the first meets ttft <= 200 ms
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["p99_ttft_ms"] == pytest.approx(100 + 200 * 0.99)  # linear interpolation, like numpy
    assert summary["mean_tpot_ms"] == pytest.approx((10 + 50) / 2)
    assert summary["mean_itl_ms"] == pytest.approx((10 * 3 + 50 * 2) / 5)
    assert summary["mean_e2el_ms"] == pytest.approx((130 + 400) / 2)
    assert summary["mean_tbt_ms"] == pytest.approx((10 + 50) / 2)
    assert summary["std_ttft_ms"] == pytest.approx(100.0)


def test_empty_run_summarizes_to_zeros() -> None:
    summary = summarize([], duration_s=1.0, slos_ms={})
    assert summary["completed"] == 0 and summary["mean_ttft_ms"] == 0.0
    assert "request_goodput" not in summary


def test_goodput_parsing_and_slo_checks() -> None:
    slos = parse_goodput(["ttft:500", "tbt:100", "e2el:2000", "tpot:50"])
    assert slos == {"ttft": 500.0, "tbt": 100.0, "e2el": 2000.0, "tpot": 50.0}
    assert meets_slos(result(0.4, [0.04, 0.04]), slos)
    assert not meets_slos(result(0.4, [0.04, 0.15]), {"tbt": 100})
    assert meets_slos(result(0.4, [], num_output_tokens=1), {"tpot": 1, "tbt": 1})
    for bad in ("ttft", "ttft:abc", "speed:1", "ttft:-5"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])
