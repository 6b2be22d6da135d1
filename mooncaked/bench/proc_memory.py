"""Resident memory of a process tree, read from /proc (Linux).

1. `process_tree(pid)`: the pid and every descendant (/proc/<pid>/task/*/children).
2. `read_memory(pid, kinds)`: VmRSS and its anonymous, file and shared-memory parts (/proc/<pid>/status), PSS
   (smaps_rollup: each page divided among the processes that map it, so the sum over processes counts it once),
   and per kind of mapping (e.g. the store's pool, weight files: a predicate on the mapped path) the resident
   and proportional bytes of those mappings (smaps).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class MappedBytes:
    rss: int = 0
    pss: int = 0


@dataclass(frozen=True)
class MeasuredMemory:
    pid: int
    rss: int
    rss_anon: int
    rss_file: int
    rss_shmem: int
    pss: int
    mapped: dict[str, MappedBytes] = field(default_factory=dict)  # kind -> bytes of the mappings of that kind


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, parents before children; processes that exit meanwhile are left out."""
    pids, index = [pid], 0
    while index < len(pids):
        for task in (PROC / str(pids[index]) / "task").glob("*/children"):
            try:
                pids.extend(int(child) for child in task.read_text().split())
            except OSError:
                continue
        index += 1
    return pids


def command_line(pid: int) -> list[str]:
    return (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def read_memory(pid: int, kinds: Mapping[str, Callable[[str], bool]] | None = None) -> MeasuredMemory:
    """OSError (FileNotFoundError) when the process is gone."""
    status = _fields((PROC / str(pid) / "status").read_text())
    rollup = _fields((PROC / str(pid) / "smaps_rollup").read_text())
    mapped = _mapped(pid, kinds) if kinds else {}
    return MeasuredMemory(pid, status["VmRSS"], status.get("RssAnon", 0), status.get("RssFile", 0),
                          status.get("RssShmem", 0), rollup["Pss"], mapped)


def _fields(text: str) -> dict[str, int]:
    """'Name:   123 kB' lines -> {Name: bytes}."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024
    return values


def _mapped(pid: int, kinds: Mapping[str, Callable[[str], bool]]) -> dict[str, MappedBytes]:
    totals = {kind: [0, 0] for kind in kinds}
    current: list[int] | None = None
    for line in (PROC / str(pid) / "smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line: range perms ... path
            path = head[5] if len(head) == 6 else ""
            current = next((totals[k] for k, matches in kinds.items() if matches(path)), None)
        elif current is not None and head and head[0] in ("Rss:", "Pss:"):
            current[0 if head[0] == "Rss:" else 1] += int(head[1]) * 1024
    return {kind: MappedBytes(rss, pss) for kind, (rss, pss) in totals.items()}
