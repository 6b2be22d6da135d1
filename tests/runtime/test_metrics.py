"""Metrics: names and labels appear in the exposition and values move; registries are independent."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncaked.runtime.metrics import Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_request_metrics_move() -> None:
    metrics = Metrics()
    metrics.requests.observe_finished(status="ok", ttft_s=0.05, e2e_s=1.05, num_output_tokens=11)
    metrics.requests.observe_rejection("tbt_slo")
    values = samples(metrics)
    assert values[("mooncaked_requests_total", (("status", "ok"),))] == 1
    assert values[("mooncaked_requests_total", (("status", "rejected"),))] == 1
    assert values[("mooncaked_rejections_total", (("reason", "tbt_slo"),))] == 1
    assert values[("mooncaked_time_to_first_token_seconds_count", ())] == 1
    assert values[("mooncaked_time_to_first_token_seconds_bucket", (("le", "0.06"),))] == 1
    assert values[("mooncaked_time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 0
    assert values[("mooncaked_time_per_output_token_seconds_sum", ())] == pytest.approx(0.1)
    assert values[("mooncaked_e2e_request_latency_seconds_sum", ())] == pytest.approx(1.05)
    assert values[("mooncaked_generation_tokens_total", ())] == 11


def test_queue_engine_cache_metrics_move() -> None:
    metrics = Metrics()
    metrics.queues.set_length("prefill", 3)
    metrics.queues.observe_wait("prefill", 0.2)
    metrics.engine.observe_step("decode", num_requests=8, num_tokens=8, step_s=0.03)
    metrics.cache.observe_prefix(num_local=5, num_remote=2, num_computed=1)
    metrics.cache.observe_transfer("write", 4096)
    metrics.cache.set_store_usage("dram", used_bytes=100, capacity_bytes=1000, num_blocks=2)
    metrics.cache.observe_evictions("ssd", 4)
    values = samples(metrics)
    assert values[("mooncaked_queue_length", (("queue", "prefill"),))] == 3
    assert values[("mooncaked_queue_time_seconds_count", (("queue", "prefill"),))] == 1
    assert values[("mooncaked_batch_size_sum", (("phase", "decode"),))] == 8
    assert values[("mooncaked_step_time_seconds_count", (("phase", "decode"),))] == 1
    assert values[("mooncaked_prefix_blocks_reused_total", (("location", "local"),))] == 5
    assert values[("mooncaked_prefix_blocks_reused_total", (("location", "remote"),))] == 2
    assert values[("mooncaked_prefix_blocks_computed_total", ())] == 1
    assert values[("mooncaked_transfer_bytes_total", (("direction", "write"),))] == 4096
    assert values[("mooncaked_store_used_bytes", (("tier", "dram"),))] == 100
    assert values[("mooncaked_store_capacity_bytes", (("tier", "dram"),))] == 1000
    assert values[("mooncaked_evictions_total", (("tier", "ssd"),))] == 4


def test_registries_are_independent_and_names_prefixed() -> None:
    first, second = Metrics(), Metrics()
    first.requests.observe_rejection("memory")
    assert ("mooncaked_rejections_total", (("reason", "memory"),)) not in samples(second)
    names = {name for name, _ in samples(first)}
    assert names and all(name.startswith("mooncaked_") for name in names)


def test_closed_label_sets_are_checked() -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match="phase"):
        metrics.engine.observe_step("train", num_requests=1, num_tokens=1, step_s=0.1)
    with pytest.raises(ValueError, match="status"):
        metrics.requests.observe_finished(status="great", ttft_s=None, e2e_s=1.0, num_output_tokens=0)
