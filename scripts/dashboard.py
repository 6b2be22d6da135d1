"""Writes deploy/grafana/mooncaked.json, the Grafana dashboard over mooncaked's Prometheus metrics.

    python scripts/dashboard.py

Rows of panels; each panel's PromQL uses $__rate_interval and the `datasource` variable. The dashboard test
(tests/deploy/test_dashboard.py) evaluates every panel against a real Prometheus scraping a live cluster.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

R = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "mooncaked.json"


def series(title: str, exprs: list[tuple[str, str]], unit: str = "short", width: int = 12) -> dict[str, Any]:
    targets = [{"expr": e, "legendFormat": legend, "refId": chr(65 + i), "datasource": DATASOURCE}
               for i, (e, legend) in enumerate(exprs)]
    return {"type": "timeseries", "title": title, "datasource": DATASOURCE, "targets": targets,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}}, "w": width, "h": 8}


def stat(title: str, expr: str, unit: str = "short") -> dict[str, Any]:
    return {**series(title, [(expr, title)], unit, width=6), "type": "stat", "h": 4}


def quantile(metric: str, q: float, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket[{R}])))"


def ratio(part: str, whole: str) -> str:
    return f"{part} / clamp_min({whole}, 1e-9)"


TTFT, TPOT = "mooncaked_time_to_first_token_seconds", "mooncaked_time_per_output_token_seconds"
REUSED, COMPUTED = "mooncaked_prefix_blocks_reused_total", "mooncaked_prefix_blocks_computed_total"

ROWS: list[tuple[str, list[dict[str, Any]]]] = [
    ("Cluster overview", [
        stat("Instances up", 'count(up{job=~"mooncaked-.*"} == 1)'),
        stat("Requests/s", f"sum(rate(mooncaked_requests_total[{R}]))", "reqps"),
        stat("Prefix hit rate", ratio(f"sum(rate({REUSED}[{R}]))",
                                      f"sum(rate({REUSED}[{R}])) + sum(rate({COMPUTED}[{R}]))"), "percentunit"),
        stat("Store used", "sum(mooncaked_store_used_bytes)", "bytes"),
        series("Requests by outcome", [(f"sum by (status) (rate(mooncaked_requests_total[{R}]))", "{{status}}")],
               "reqps"),
        series("Queue lengths", [("sum by (queue) (mooncaked_queue_length)", "{{queue}}")]),
    ]),
    ("Latency and SLOs", [
        series("Time to first token", [(quantile(TTFT, q), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)], "s"),
        series("Time per output token (TBT)", [(quantile(TPOT, q), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)],
               "s"),
        series("SLO attainment (TTFT <= 30 s, TPOT <= 1 s: the default SLOs)", [
            (ratio(f'sum(rate({TTFT}_bucket{{le="30.0"}}[{R}]))', f"sum(rate({TTFT}_count[{R}]))"), "TTFT"),
            (ratio(f'sum(rate({TPOT}_bucket{{le="1.0"}}[{R}]))', f"sum(rate({TPOT}_count[{R}]))"), "TPOT")],
            "percentunit"),
        series("End-to-end latency", [(quantile("mooncaked_e2e_request_latency_seconds", q), f"p{round(q * 100)}")
                                      for q in (0.5, 0.9)], "s"),
        series("Rejections by reason", [(f"sum by (reason) (rate(mooncaked_rejections_total[{R}])) or vector(0)",
                                         "{{reason}}")], "reqps"),
        series("Prediction error (median, relative)", [
            (quantile("mooncaked_ttft_prediction_relative_error", 0.5), "TTFT"),
            (quantile("mooncaked_tbt_prediction_relative_error", 0.5), "TBT")], "percentunit"),
    ]),
    ("KVCache pool and transfers", [
        series("Pool use by tier", [("sum by (tier) (mooncaked_store_used_bytes)", "used {{tier}}"),
                                    ("sum by (tier) (mooncaked_store_capacity_bytes)", "capacity {{tier}}")], "bytes"),
        series("Prefix blocks", [(f"sum by (location) (rate({REUSED}[{R}]))", "reused {{location}}"),
                                 (f"sum(rate({COMPUTED}[{R}]))", "computed")]),
        series("Transfer throughput", [(f"sum by (direction) (rate(mooncaked_transfer_bytes_total[{R}]))",
                                        "{{direction}}")], "Bps"),
        series("Evictions by tier", [(f"sum by (tier) (rate(mooncaked_evictions_total[{R}])) or vector(0)",
                                      "{{tier}}")]),
    ]),
    ("Engines and the fleet", [
        series("Step time by phase (p90)", [(quantile("mooncaked_step_time_seconds", 0.9, "le, phase"), "{{phase}}")],
               "s"),
        series("Batch size by phase (p50)", [(quantile("mooncaked_batch_size", 0.5, "le, phase"), "{{phase}}")]),
        series("Migrations by cause", [(f"sum by (cause) (rate(mooncaked_migrations_total[{R}])) or vector(0)",
                                        "{{cause}}")], "reqps"),
        series("Role switches", [(f"sum by (from_role, to_role) (increase(mooncaked_role_switches_total[{R}])) "
                                  "or vector(0)", "{{from_role}} -> {{to_role}}")]),
    ]),
    ("Tenants", [
        series("Requests by tenant", [(f"sum by (tenant) (rate(mooncaked_tenant_requests_total[{R}])) or vector(0)",
                                       "{{tenant}}")], "reqps"),
        series("Tokens by tenant", [(f"sum by (tenant, kind) (rate(mooncaked_tenant_tokens_total[{R}])) "
                                     "or vector(0)", "{{tenant}} {{kind}}")]),
        series("Rejections by tenant (429s, rate limits included)", [
            (f"sum by (tenant, reason) (rate(mooncaked_tenant_rejections_total[{R}])) or vector(0)",
             "{{tenant}} {{reason}}")], "reqps"),
        series("Pool bytes by tenant and tier", [("sum by (tenant, tier) (mooncaked_tenant_pool_bytes) or vector(0)",
                                                  "{{tenant}} {{tier}}")], "bytes"),
    ]),
]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, items in ROWS:
        panels.append({"type": "row", "title": title, "id": len(panels) + 1, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        y += 1
        x = height = 0
        for item in items:
            panel = dict(item)
            width, h = panel.pop("w"), panel.pop("h")
            if x + width > 24:
                x, y, height = 0, y + height, 0
            panels.append({**panel, "id": len(panels) + 1, "gridPos": {"x": x, "y": y, "w": width, "h": h}})
            x, height = x + width, max(height, h)
        y += height
    return {"title": "mooncaked", "uid": "mooncaked-overview", "tags": ["mooncaked", "llm-serving"],
            "timezone": "browser", "schemaVersion": 38, "version": 1, "refresh": "10s",
            "time": {"from": "now-30m", "to": "now"},
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                     "label": "Prometheus", "current": {}, "hide": 0}]},
            "panels": panels}


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=1) + "\n")
