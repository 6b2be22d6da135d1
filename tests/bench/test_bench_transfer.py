"""A short run of `mooncaked bench transfer`: every system (the engine with and without a secret too) moves the
bytes, the handshakes are timed, and the JSON is complete."""

from __future__ import annotations

import json
from pathlib import Path

from mooncaked.cli import main


def test_transfer_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    assert main(["bench", "transfer", "--total-gib", "0.0625", "--request-mib", "8", "--repeats", "1",
                 "--handshake-samples", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("engine_gbps", "engine_auth_gbps", "raw_socket_gbps", "gloo_gbps", "memcpy_gbps", "ratio_vs_raw",
                "ratio_vs_gloo", "handshake_ms_open", "handshake_ms_secret", "handshake_share"):
        assert result[key] > 0, key
    assert result["handshake_ms_secret"] < 1000 and -1 < result["auth_overhead"] < 10
    assert len(result["pass_gbps"]["engine_auth"]) == 1
