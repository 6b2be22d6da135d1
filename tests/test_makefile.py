"""The Makefile's order: `make test` (and `make bench`) installs Debian's packages before it creates the venv,
and links Debian's pyverbs into the venv after both, so a fresh clone's venv gets pyverbs (read with `make -n`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run(target: str, venv: Path) -> list[str]:
    """The commands `make TARGET` would run for a venv that does not exist yet, in order."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", "--no-print-directory", target, f"VENV={venv}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.splitlines()


def first(commands: list[str], text: str) -> int:
    return next(i for i, command in enumerate(commands) if text in command)


@pytest.mark.parametrize("target", ["test", "bench"])
def test_debian_packages_come_before_the_venv_and_pyverbs_after_both(tmp_path: Path, target: str) -> None:
    commands = dry_run(target, tmp_path / "venv")
    debs, venv = first(commands, "scripts/install_debs.sh"), first(commands, "-m venv")
    pyverbs = first(commands, "scripts/setup_pyverbs.sh")
    assert debs < venv < pyverbs, commands


def test_run_and_venv_link_pyverbs_without_installing_packages(tmp_path: Path) -> None:
    for target in ("venv", "run"):
        commands = dry_run(target, tmp_path / "venv")
        assert not any("install_debs.sh" in command for command in commands)
        assert first(commands, "-m venv") < first(commands, "scripts/setup_pyverbs.sh")
