"""Every role serves Prometheus metrics on its metrics_port: store usage, prefill/decode steps, prefix reuse."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from mooncaked.config import Config
from mooncaked.roles.base import PeerClients
from tests.roles.cluster_fixtures import cluster_config, free_port, instance, running_roles
from tests.roles.test_disagg_roles import generate


async def scrape(config: Config, name: str) -> str:
    entry = config.instance_named(name)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{entry.host}:{entry.metrics_port}/metrics") as response:
            assert response.status == 200
            return await response.text()


def value(text: str, prefix: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert lines, f"{prefix} not in metrics"
    return float(lines[0].rsplit(" ", 1)[1])


async def test_roles_serve_metrics(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("s0", "store", metrics_port=free_port()),
                                       instance("p0", "prefill", metrics_port=free_port()),
                                       instance("d0", "decode", metrics_port=free_port())])
    tokens = list(range(3, 60))
    async with running_roles(config, ["s0", "p0", "d0"]):
        clients = PeerClients(config, config.instance_named("p0"))
        try:
            await generate(config, clients, "m1", tokens, 4)
            await generate(config, clients, "m2", tokens, 4)
        finally:
            await clients.close()
        store = await scrape(config, "s0")
        assert value(store, 'mooncaked_store_blocks{tier="dram"}') == 3
        assert value(store, 'mooncaked_store_used_bytes{tier="dram"}') > 0
        prefill = await scrape(config, "p0")
        assert value(prefill, 'mooncaked_step_time_seconds_count{phase="prefill"}') == 2
        assert value(prefill, 'mooncaked_prefix_blocks_reused_total{location="local"}') == 3
        assert value(prefill, "mooncaked_transfer_bytes_total{direction=\"write\"}") > 0
        decode = await scrape(config, "d0")
        assert value(decode, 'mooncaked_step_time_seconds_count{phase="decode"}') >= 6
        assert 'mooncaked_queue_length{queue="decode"} 0.0' in decode
