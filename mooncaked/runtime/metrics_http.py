"""A role's own Prometheus endpoint: `GET /metrics` on the instance's `metrics_port` (0: none).

1. `MetricsEndpoint(host, port, metrics, refresh)`; `start()` listens, `stop()` closes it.
2. On every scrape `refresh()` first copies pulled state (store usage, queue lengths) into gauges, so no
   background task is needed; counters and histograms are updated where the work happens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from mooncaked.runtime.metrics import CONTENT_TYPE, Metrics

logger = logging.getLogger(__name__)


class MetricsEndpoint:
    """Owns the aiohttp runner serving one process's metrics."""

    def __init__(self, host: str, port: int, metrics: Metrics, refresh: Callable[[], None] = lambda: None) -> None:
        self.host = host
        self.port = port
        self.metrics = metrics
        self.refresh = refresh
        self._runner: web.AppRunner | None = None

    async def _serve(self, request: web.Request) -> web.Response:
        self.refresh()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def start(self) -> None:
        if not self.port:
            return
        app = web.Application()
        app.router.add_get("/metrics", self._serve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        logger.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
