"""A transfer engine in a separate process, for tests that kill a peer."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection

from mooncaked.transfer import TransferEngine


def serve_segment(conn: Connection, host: str, num_bytes: int, lifetime_s: float) -> None:
    """Register one segment named "sink", send the endpoint over `conn`, serve until killed or `lifetime_s`."""

    async def main() -> None:
        engine = TransferEngine(host=host)
        await engine.start()
        engine.register("sink", bytearray(num_bytes))
        conn.send(engine.endpoint)
        await asyncio.sleep(lifetime_s)
        await engine.stop()

    asyncio.run(main())
