"""The systemd unit's ExecStart is a command line the real CLI accepts."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

from mooncaked.cli import build_parser
from mooncaked.config import ROLES
from mooncaked.runtime.lifecycle import EXIT_FATAL

UNIT = Path(__file__).resolve().parents[1] / "systemd" / "mooncaked@.service"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT)
    return parser


def test_unit_settings() -> None:
    service = unit()["Service"]
    assert service["Type"] == "notify"
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == str(EXIT_FATAL)  # a configuration or load error
    assert service["LimitMEMLOCK"] == "infinity"
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > 10  # covers runtime.drain_timeout_s's default


def test_exec_start_parses_for_every_role() -> None:
    exec_start = unit()["Service"]["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/mooncaked")
    for role in ROLES:
        args_text = [a.replace("%i", role) for a in argv[1:] if a != "$MOONCAKED_ARGS"]
        args = build_parser(args_text).parse_args(args_text + ["--instance", f"{role}0"])
        assert args.role == role and args.config == "/etc/mooncaked/config.yaml" and args.command is None


def test_the_etcd_unit_and_its_node_config() -> None:
    from mooncaked.config import load_config

    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT.parent / "mooncaked-etcd@.service")
    argv = shlex.split(parser["Service"]["ExecStart"])
    args_text = [a.replace("%i", "decode") for a in argv[1:] if a != "$MOONCAKED_ARGS"]
    args = build_parser(args_text).parse_args(args_text + ["--instance", "gpu17-w1"])
    assert args.role == "decode" and args.config == "/etc/mooncaked/node.yaml"
    config = load_config(UNIT.parent / "node.example.yaml")
    assert config.cluster.membership == "etcd" and config.worker.switchable
    assert config.instance_for("decode", name="gpu17-w1").host == "10.0.1.17"
