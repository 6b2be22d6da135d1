"""The command line: version, check-config, and one clear line per user error."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from mooncaked import __version__
from mooncaked.cli import main, warn_if_unauthenticated
from mooncaked.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "config.example.yaml")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mooncaked", *args], capture_output=True, text=True, timeout=60)


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"mooncaked {__version__}"


def test_check_config_prints_resolved(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", EXAMPLE, "--set", "kv.block_size=32"]) == 0
    out = capsys.readouterr().out
    assert "block_size: 32" in out and "name: conductor0" in out


def test_check_config_lists_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv: {blok_size: 3}\nstore: {high_watermark: 2}\n")
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["mooncaked: error: kv.blok_size: unknown key (did you mean 'block_size'?)",
                   "mooncaked: error: store.high_watermark: must be <= 1.0, got 2.0"]


@pytest.mark.parametrize("args, message", [
    (["--role", "prefil", "--config", EXAMPLE], "unknown role 'prefil'"),
    (["--role", "store", "--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
    (["--role", "store", "--config", EXAMPLE, "--set", "kv.block_size"], "is not key.path=value"),
    (["--role", "store"], "--config FILE is required"),
    (["--config", EXAMPLE], "--role is required"),
    (["--role", "store", "--config", EXAMPLE, "--instance", "nope"], "no instance named 'nope'"),
])
def test_user_errors_exit_2_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_an_unauthenticated_cluster_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    open_cluster = load_config(EXAMPLE)
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    closed_cluster = load_config(EXAMPLE, [f"cluster.secret_file={secret}"])
    with caplog.at_level(logging.WARNING, logger="mooncaked.cli"):
        warn_if_unauthenticated(closed_cluster)
        assert not caplog.records
        warn_if_unauthenticated(open_cluster)
    assert len(caplog.records) == 1 and "unauthenticated" in caplog.records[0].getMessage()
    assert "s3cret" not in caplog.text
