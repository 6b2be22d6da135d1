"""RPC messages of runtime role switching (conductor leader -> switchable prefill or decode instance).

SWITCH asks the instance to become `role`: it marks itself draining, lets its in-flight work finish (up to
`drain_timeout_s`), switches in place keeping its weights and KV pages, and registers again under the new role.
The reply comes once it serves as `role` (or says why it did not switch).
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.rpc import Message, Method


@dataclass(frozen=True)
class SwitchRequest(Message):
    role: str  # "prefill" | "decode"
    reason: str = ""
    drain_timeout_s: float = 30.0


@dataclass(frozen=True)
class SwitchReply(Message):
    role: str  # the role it serves now
    is_switched: bool
    reason: str = ""  # why it did not switch
    drain_s: float = 0.0
    num_cancelled: int = 0  # in-flight requests still running at the drain deadline
    num_switches: int = 0  # since the process started


SWITCH = Method("switch", SwitchRequest, SwitchReply)
