"""CPU pinning of one instance's process (`cluster.instances[].cpus`).

1. main() calls `pin_to_cpus` for the instance it runs, before torch starts its thread pools and before the
   event loop exists: it sets every thread the process has, and every thread started later inherits the set.
2. CPU ids this process may not use (absent, offline, outside its cgroup's cpuset) are an error that names them
   and the usable ones; nothing is pinned then.
3. Within a worker, `pinned_executor(name, cpus)` runs one thread pinned to a subset (`worker.compute_cpus`,
   `worker.copy_cpus`), so the compute thread and the KV copy thread do not take turns on one core.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Sequence

logger = logging.getLogger(__name__)


class CpuAffinityError(ValueError):
    """The configured CPUs cannot be used by this process."""


def usable_cpus() -> set[int]:
    """CPU ids this process may run on."""
    return set(os.sched_getaffinity(0))


def pin_to_cpus(cpus: Sequence[int], instance_name: str) -> None:
    """Restrict this process (every thread it has, and every thread it starts later) to `cpus`."""
    check_usable(cpus, f"instance {instance_name}", "cluster.instances[].cpus")
    # sched_setaffinity sets one thread's mask; threads started later inherit the caller's. Threads an import
    # started already (numpy's BLAS pool, loaded with the config's modules) are each set too.
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    os.sched_setaffinity(0, cpus)
    logger.info("instance %s pinned to CPUs %s", instance_name, format_cpus(cpus))


def check_usable(cpus: Sequence[int], what: str, option: str) -> None:
    """CpuAffinityError naming `option` when some of `cpus` are not usable by this process."""
    usable = usable_cpus()
    missing = sorted(set(cpus) - usable)
    if missing:
        raise CpuAffinityError(f"{what}: cpus {missing} are not usable by this process "
                               f"(usable: {format_cpus(usable)}); fix {option}")


def pinned_executor(name: str, cpus: Sequence[int], option: str) -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread that pins itself to `cpus` before its first job (empty: no pinning); CpuAffinityError
    naming `option` when they are not usable."""
    check_usable(cpus, f"thread {name}", option)
    if not cpus:
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                                 initializer=os.sched_setaffinity, initargs=(0, list(cpus)))


def format_cpus(cpus: Sequence[int] | set[int]) -> str:
    """Sorted ids with runs collapsed, as Linux prints them: [0, 1, 2, 5] -> "0-2,5"."""
    ids = sorted(set(cpus))
    runs: list[str] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append(str(ids[start]) if start == i - 1 else f"{ids[start]}-{ids[i - 1]}")
            start = i
    return ",".join(runs)
