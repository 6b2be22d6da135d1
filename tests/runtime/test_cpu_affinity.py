"""CPU pinning of an instance's process: the ids are checked, the set applied, bad ids named."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mooncaked.config import ConfigError, load_config
from mooncaked.runtime.cpu_affinity import CpuAffinityError, format_cpus, pin_to_cpus, pinned_executor, usable_cpus


@pytest.fixture
def restore_affinity() -> Iterator[set[int]]:
    before = os.sched_getaffinity(0)
    yield before
    os.sched_setaffinity(0, before)


PIN_SCRIPT = """
import os, sys, threading
from mooncaked.runtime.cpu_affinity import pin_to_cpus
started = threading.Event()
done = threading.Event()
early = threading.Thread(target=lambda: (started.set(), done.wait(10)))  # as an import's thread pool would be
early.start()
started.wait(10)
pin_to_cpus([int(sys.argv[1])], "p0")
later = threading.Thread(target=lambda: done.wait(10))
later.start()
print(sorted({frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}, key=len))
done.set()
"""


def test_pin_to_one_usable_cpu_pins_every_thread_the_process_has_and_starts() -> None:
    cpu = min(os.sched_getaffinity(0))  # in a process of its own: pinning changes every thread of it
    out = subprocess.run([sys.executable, "-c", PIN_SCRIPT, str(cpu)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.strip() == f"[frozenset({{{cpu}}})]"


def test_unusable_cpus_are_named_and_nothing_changes(restore_affinity: set[int]) -> None:
    with pytest.raises(CpuAffinityError, match=r"instance p0: cpus \[4095\] are not usable .*usable: "):
        pin_to_cpus([min(restore_affinity), 4095], "p0")
    assert os.sched_getaffinity(0) == restore_affinity == usable_cpus()


def test_format_collapses_runs() -> None:
    assert format_cpus([5, 0, 1, 2]) == "0-2,5"
    assert format_cpus({3}) == "3"
    assert format_cpus([0, 2, 4, 5]) == "0,2,4-5"


def test_config_rejects_negative_or_repeated_ids(tmp_path: Path) -> None:
    for cpus in ([-1], [0, 0]):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"cluster": {"instances": [
            {"name": "s0", "role": "store", "port": 7000, "data_port": 7001, "cpus": cpus}]}}))
        with pytest.raises(ConfigError, match=r"cluster.instances\[0\].cpus: CPU ids must be distinct and >= 0"):
            load_config(path)


def test_role_with_unusable_cpus_exits_2_naming_them(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"instances": [
        {"name": "s0", "role": "store", "port": 7000, "data_port": 7001, "cpus": [4095]}]}}))
    done = subprocess.run([sys.executable, "-m", "mooncaked", "--role", "store", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "mooncaked: error: instance s0: cpus [4095] are not usable" in done.stderr


def test_pinned_executor_pins_its_thread_only(restore_affinity: set[int]) -> None:
    cpu = max(restore_affinity)
    executor = pinned_executor("pin-test", [cpu], "worker.copy_cpus")
    try:
        assert executor.submit(os.sched_getaffinity, 0).result(timeout=10) == {cpu}
    finally:
        executor.shutdown(wait=True)
    assert os.sched_getaffinity(0) == restore_affinity
    with pytest.raises(CpuAffinityError, match=r"thread kv-copy: cpus \[4095\] .* fix worker.copy_cpus"):
        pinned_executor("kv-copy", [4095], "worker.copy_cpus")
