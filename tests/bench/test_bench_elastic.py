"""`bench elastic --background-load N`: N spinning processes at nice 19 for the goodput runs, none left after."""

from __future__ import annotations

import os

from mooncaked.bench.elastic import background_load, switches_per_phase


def _children_at_nice_19() -> set[int]:
    """This process's children running at nice 19 (/proc/PID/stat: ppid is field 4, nice field 19)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and int(fields[16]) == 19:
            found.add(int(entry))
    return found


def test_the_background_load_runs_at_nice_19_and_is_gone_after() -> None:
    with background_load(2):
        assert len(_children_at_nice_19()) == 2
    assert not _children_at_nice_19()


def test_switches_are_counted_in_the_phase_they_happen() -> None:
    started = 1000.0
    switches = [{"at": started + 25.0, "is_switched": True}, {"at": started + 27.0, "is_switched": True},
                {"at": started + 45.0, "is_switched": True}, {"at": started + 46.0, "is_switched": False},
                {"at": started + 95.0, "is_switched": True}, {"at": started - 1.0, "is_switched": True}]
    assert switches_per_phase(switches, started, phase_s=20.0) == [1, 2, 2]
