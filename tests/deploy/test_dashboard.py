"""The shipped Grafana dashboard against a real Prometheus scraping a running cluster: every panel's PromQL
parses and returns data. Skips only when no `prometheus` binary exists (`make debs` installs Debian's)."""

from __future__ import annotations

import asyncio
import json
import runpy
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.roles.cluster_fixtures import cluster_config, free_port, instance, running_roles
from tests.roles.test_conductor_flow import GREEDY, completion, prompt

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "mooncaked.json"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"].replace("$__rate_interval", "30s")


def test_the_dashboard_and_scrape_config_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = list(panel_queries(dashboard))
    assert len(queries) >= 20 and all(expr.strip() for _, expr in queries)
    generated = json.loads(json.dumps(runpy.run_path(str(REPO / "scripts" / "dashboard.py"))["dashboard"]()))
    assert generated == dashboard, "deploy/grafana/mooncaked.json is stale: run python scripts/dashboard.py"
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for topic in ("first token", "TBT", "SLO", "hit rate", "Pool use by tier", "Transfer", "Rejections", "tenant"):
        assert topic in titles
    jobs = yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
    ports = {t.split(":")[1] for job in jobs for entry in job["static_configs"] for t in entry["targets"]}
    assert ports == {"8000", "9101", "9103", "9104"}  # config.example.yaml's conductor and metrics ports


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (make debs installs Debian's prometheus)")
async def test_every_panel_returns_data_from_a_scraped_cluster(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - id: team-a\n    api_keys: [key-a]\n")
    config = cluster_config(tmp_path, [
        instance("s0", "store", metrics_port=free_port()), instance("p0", "prefill", metrics_port=free_port()),
        instance("d0", "decode", metrics_port=free_port()), instance("c0", "conductor")],
        worker={"inline_prefill_max_tokens": 0}, conductor={"tenants_file": str(tenants)})
    targets = [f"127.0.0.1:{config.instance_named('c0').port}"] + [
        f"127.0.0.1:{config.instance_named(n).metrics_port}" for n in ("s0", "p0", "d0")]
    port = free_port()
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), \
            aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as http:
        with prometheus(tmp_path, targets, port):
            base = f"http://127.0.0.1:{port}"
            await wait_for(http, base, "count(up == 1)", lambda r: r and float(r[0]["value"][1]) == 4)
            tokens = prompt(70, 80)
            for i in range(4):  # the same prompt again: prefix reuse; a second one: new blocks
                await completion(http, config, {"prompt": tokens if i % 2 else prompt(71 + i, 80), "max_tokens": 4,
                                                **GREEDY})
            loaded_at = time.time()  # every target scraped twice more: each rate() window holds the requests
            await wait_for(http, base, "min(timestamp(up))",
                           lambda r: r and float(r[0]["value"][1]) > loaded_at + 1.5)
            empty = [(title, expr) for title, expr in panel_queries(json.loads(DASHBOARD.read_text()))
                     if not await query(http, base, expr)]
            assert not empty, f"panels with no data: {empty}"


class prometheus:
    """A Prometheus server on loopback scraping `targets` every second; stopped on exit."""

    def __init__(self, tmp_path: Path, targets: list[str], port: int) -> None:
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": f"mooncaked-{i}", "static_configs": [{"targets": [t]}]}
                                     for i, t in enumerate(targets)]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.args = [str(PROMETHEUS), f"--config.file={tmp_path / 'prometheus.yml'}",
                     f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"]
        self.log = tmp_path / "prometheus.log"

    def __enter__(self) -> prometheus:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=log)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


async def query(http: aiohttp.ClientSession, base: str, expr: str) -> list[Any]:
    async with http.get(base + "/api/v1/query", params={"query": expr}) as response:
        body = await response.json()
    assert response.status == 200 and body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


async def wait_for(http: aiohttp.ClientSession, base: str, expr: str, is_done: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if is_done(await query(http, base, expr)):
                return
        except aiohttp.ClientError:
            pass  # prometheus is still starting
        assert time.monotonic() < deadline, f"{expr} not reached within {timeout_s} s"
        await asyncio.sleep(0.5)
