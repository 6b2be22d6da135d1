"""The `mooncaked` command.

1. Parse arguments: `--role ROLE --config FILE [--set k=v ...] [--instance NAME]`, `--version`,
   or a subcommand: `check-config FILE`, `bench NAME ...`, `sim ...`.
2. Read the environment here and nowhere below: NOTIFY_SOCKET and WATCHDOG_USEC (systemd), and
   XDG_CACHE_HOME or HOME for the default `model.weight_cache_dir`.
3. Load the one frozen config, set up logging and torch threads, then hand the role object to the runner.
   `check-config` prints the resolved config and, as YAML comments, each process's expected resident memory.

Every user error exits non-zero with one clear line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from mooncaked import __version__
from mooncaked.config import ROLES, Config, ConfigError, config_as_dict, load_config

logger = logging.getLogger(__name__)

BENCHMARKS = ("rpc", "model", "kernels", "transfer", "store", "sched", "serve", "pd", "prefix", "layerwise",
              "elastic", "chaos", "batch", "memory", "cpp", "agents", "network", "tiers")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the benchmark or simulator module named in `argv` is imported (they pull in torch)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="mooncaked", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"mooncaked {__version__}")
    parser.add_argument("--role", help="conductor | prefill | decode | store | all")
    parser.add_argument("--config", help="cluster YAML file (see config.example.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override one config value (repeatable)")
    parser.add_argument("--instance", help="this process's instance name in cluster.instances")
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check-config", help="print the resolved config or every error")
    check.add_argument("file")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name in BENCHMARKS:
        bench_parser = bench_sub.add_parser(name, help=f"mooncaked bench {name}")
        if argv[:2] == ["bench", name]:
            _attach_module_arguments(bench_parser, f"mooncaked.bench.{name}")
    sim = sub.add_parser("sim", help="the scheduler on virtual time (trace replay)")
    if argv[:1] == ["sim"]:
        _attach_module_arguments(sim, "mooncaked.sim.cli")
    return parser


def _attach_module_arguments(parser: argparse.ArgumentParser, module_name: str) -> None:
    """Modules expose add_arguments(parser) and run(args) -> int; a missing module is reported when run."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        parser.set_defaults(runner=_missing_module(module_name))
        return
    module.add_arguments(parser)
    parser.set_defaults(runner=module.run)


def _missing_module(module_name: str) -> Callable[[argparse.Namespace], int]:
    def runner(args: argparse.Namespace) -> int:
        raise CliError(f"{module_name} is not available in this build")

    return runner


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    try:
        return _dispatch(args)
    except (CliError, ConfigError) as exc:
        for line in str(exc).splitlines():
            print(f"mooncaked: error: {line}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "check-config":
        return _check_config(args.file, args.overrides)
    if args.command == "sim" and getattr(args, "model_config", None):
        args.set = [*_sim_model_settings(args.model_config, args.model_dtype_bytes), *args.set]
    if args.command in ("bench", "sim"):
        return int(args.runner(args))
    if not args.role:
        raise CliError("--role is required (conductor | prefill | decode | store | all); see --help")
    if not args.config:
        raise CliError("--config FILE is required with --role")
    if args.role not in (*ROLES, "all"):
        raise CliError(f"unknown role {args.role!r}: use one of {', '.join((*ROLES, 'all'))}")
    config = with_default_paths(load_config(args.config, args.overrides), os.environ)
    return _run_role(args, config)


def _sim_model_settings(path: str, dtype_bytes: int) -> list[str]:
    """`--set model.KEY=VALUE` items of the model whose config.json is `path` (or in it)."""
    from mooncaked.model.families import args_from_hf_config
    from mooncaked.model.sim_shape import sim_model_settings
    config_path = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        args = args_from_hf_config(json.loads(config_path.read_text()))
        settings = sim_model_settings(args, dtype_bytes)
    except (OSError, ValueError) as exc:
        raise CliError(f"--model-config {path}: {exc}") from exc
    return [f"model.{key}={value}" for key, value in settings.items()]


def with_default_paths(config: Config, environ: Mapping[str, str]) -> Config:
    """`model.weight_cache_dir` when left null: $XDG_CACHE_HOME/mooncaked/weights, else ~/.cache/mooncaked/weights
    (unchanged, so weights stay private, when neither variable is set)."""
    if config.model.weight_cache_dir is not None:
        return config
    base = environ.get("XDG_CACHE_HOME") or (str(Path(environ["HOME"]) / ".cache") if environ.get("HOME") else "")
    if not base:
        return config
    model = dataclasses.replace(config.model, weight_cache_dir=str(Path(base) / "mooncaked" / "weights"))
    return dataclasses.replace(config, model=model)


def _check_config(path: str, overrides: list[str]) -> int:
    import yaml

    from mooncaked.engine.kv_budget import KVBudgetTooSmall
    from mooncaked.config.memory_plan import plan_memory, render
    from mooncaked.model.loader import model_args

    config = with_default_paths(load_config(path, overrides), os.environ)
    try:
        plans = plan_memory(config, model_args(config.model.source))
    except (KVBudgetTooSmall, OSError, ValueError) as exc:
        raise CliError(f"memory plan: {exc}") from exc
    print(yaml.safe_dump(config_as_dict(config), sort_keys=False), end="")
    print("\n".join(render(plans)))
    return 0


def _run_role(args: argparse.Namespace, config: Config) -> int:
    from mooncaked.runtime.lifecycle import EXIT_FATAL, run_role, watchdog_interval
    from mooncaked.runtime.logs import setup_logging
    from mooncaked.runtime.sdnotify import Notifier

    notifier = Notifier(os.environ.get("NOTIFY_SOCKET"))
    interval = watchdog_interval(os.environ.get("WATCHDOG_USEC"))
    if args.role == "all":
        from mooncaked.roles.supervisor import Supervisor

        setup_logging(config.runtime.log_level, config.runtime.log_format, "supervisor")
        supervisor = Supervisor(config, config_path=args.config, overrides=args.overrides)
        exit_code = run_role(lambda: supervisor, notifier, interval, supervisor.stop_requested)
        return EXIT_FATAL if supervisor.fatal_error else exit_code
    instance = config.instance_for(args.role, name=args.instance)
    setup_logging(config.runtime.log_level, config.runtime.log_format, instance.name)
    warn_if_unauthenticated(config)
    if instance.cpus:
        from mooncaked.runtime.cpu_affinity import CpuAffinityError, pin_to_cpus

        try:
            pin_to_cpus(instance.cpus, instance.name)
        except CpuAffinityError as exc:
            raise CliError(str(exc)) from exc
    if args.role in ("prefill", "decode"):
        _set_torch_threads(config.runtime.num_threads)
        # the compute thread takes the interpreter lock back after every op; with copy and transfer threads busy
        # the default 5 ms handover stalls it layer after layer (measured: bench layerwise)
        sys.setswitchinterval(config.runtime.gil_switch_interval_ms / 1000)
    from mooncaked.roles import make_role

    return run_role(lambda: make_role(config, instance), notifier, interval)


def warn_if_unauthenticated(config: Config) -> None:
    """One warning at start when the cluster has no secret: its RPC and data ports serve anyone."""
    if config.cluster.secret_file is None:
        logger.warning("cluster.secret_file is not set: this cluster is unauthenticated, and anyone who can reach "
                       "its RPC and data ports can read and write its KVCache (other users' prompts, in effect); "
                       "set cluster.secret_file to a file holding a shared secret")


def _set_torch_threads(num_threads: int) -> None:
    import torch

    torch.set_num_threads(num_threads)
