"""The command line: version, check-config, and one clear line per user error."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mooncaked import __version__
from mooncaked.cli import main, warn_if_unauthenticated, with_default_paths
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


def test_check_config_prints_each_process_expected_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", EXAMPLE, "--set", "worker.kv_memory_bytes=268435456"]) == 0
    rows = {line.split()[1]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("#   ")}
    # the example's bfloat16: half fp32's bytes per token, and no packed copies (MKL packing is fp32's)
    assert " ".join(rows["decode0"]).endswith("182 pages = 11648 tokens, 0.25 GiB (worker.kv_memory_bytes = 256 MiB)")
    assert main(["check-config", EXAMPLE, "--set", "worker.kv_memory_bytes=268435456", "--set",
                 "model.dtype=float32"]) == 0
    out = capsys.readouterr().out
    plan = out.partition("# expected resident memory per process")[2]
    assert yaml.safe_load(out)["worker"]["kv_memory_bytes"] == 268435456  # the comments keep it valid YAML
    rows = {line.split()[1]: line.split() for line in plan.splitlines() if line.startswith("#   ")}
    assert rows["store0"][8] == "1.00"  # the DRAM pool
    assert " ".join(rows["decode0"]).endswith("91 pages = 5824 tokens, 0.25 GiB (worker.kv_memory_bytes = 256 MiB)")
    assert rows["prefill0"][5] == "0.61" and rows["decode0"][4] == "0.50"  # shared file vs packed copies
    assert re.search(r"# host 127\.0\.0\.1: \d\.\d\d GiB in all processes, \d\.\d\d GiB with the shared weight file "
                     r"counted once", plan)


def test_check_config_refuses_a_budget_below_one_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", EXAMPLE, "--set", "worker.kv_memory_bytes=1000000",
                 "--set", "model.dtype=float32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mooncaked: error: memory plan: worker.kv_memory_bytes = 1000000 bytes holds 0 KV pages")
    assert "needs 32 pages of 2.81 MiB = 90 MiB; set worker.kv_memory_bytes to at least 94371840" in err


def test_weight_cache_dir_defaults_to_the_user_cache() -> None:
    config = load_config(EXAMPLE)
    assert with_default_paths(config, {"XDG_CACHE_HOME": "/x"}).model.weight_cache_dir == "/x/mooncaked/weights"
    assert with_default_paths(config, {"HOME": "/h"}).model.weight_cache_dir == "/h/.cache/mooncaked/weights"
    assert with_default_paths(config, {}).model.weight_cache_dir is None  # no place: weights stay private
    chosen = load_config(EXAMPLE, ["model.weight_cache_dir=/w"])
    assert with_default_paths(chosen, {"HOME": "/h"}).model.weight_cache_dir == "/w"


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
