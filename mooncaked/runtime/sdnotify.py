"""systemd's notify protocol spoken directly over NOTIFY_SOCKET (no libsystemd).

1. `Notifier(socket_path)` is built in main() from the environment (None when not under systemd: a no-op).
2. `ready()`, `stopping()`, `watchdog()`, `status(text)` send one datagram each; failures are logged, never raised.
"""

from __future__ import annotations

import logging
import socket

logger = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify datagrams; owns nothing but the socket address."""

    def __init__(self, socket_path: str | None) -> None:
        self.socket_path = socket_path

    @property
    def is_enabled(self) -> bool:
        return bool(self.socket_path)

    def send(self, message: str) -> bool:
        if not self.socket_path:
            return False
        address = self.socket_path
        if address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace socket
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(address)
                sock.sendall(message.encode())
            return True
        except OSError as exc:
            logger.warning("sd_notify %r to %s failed: %s", message, self.socket_path, exc)
            return False

    def ready(self) -> bool:
        return self.send("READY=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")
