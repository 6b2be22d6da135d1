"""`mooncaked bench memory` with the tiny model (a `--role all` tree on free ports), and the /proc readings it
takes: RSS and its parts, PSS, the bytes of given mappings, a process tree."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

from mooncaked.bench.proc_memory import command_line, process_tree, read_memory
from mooncaked.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_reads_a_mapping_it_is_told_about(tmp_path: Path) -> None:
    path = tmp_path / "blob.weights"
    path.write_bytes(b"\1" * (64 << 10))
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as mapping:
        assert sum(mapping[i] for i in range(0, len(mapping), 4096)) == 16  # touch every page
        memory = read_memory(os.getpid(), {"weights": lambda p: p == str(path), "none": lambda p: False})
    assert memory.mapped["weights"].rss == 64 << 10 and 0 < memory.mapped["weights"].pss <= 64 << 10
    assert memory.mapped["none"].rss == 0
    assert memory.rss >= memory.rss_anon + memory.rss_file and 0 < memory.pss <= memory.rss


def test_a_process_tree_lists_children() -> None:
    script = "import sys; print('ready', flush=True); sys.stdin.readline()"
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"  # exec'd: its own command line
        assert child.pid in process_tree(os.getpid())
        assert command_line(child.pid)[1:] == ["-c", script]
    finally:
        child.communicate(b"\n", timeout=10)


def test_memory_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    sets = ["model.source=random:tiny", "model.name=tiny", "model.max_model_len=512", "store.dram_bytes=33554432",
            f"store.shm_dir={tmp_path}", "worker.kv_memory_bytes=4194304", "worker.profile_s=0.2"]
    assert main(["bench", "memory", "--config", str(ROOT / "config.example.yaml"), "--requests", "2",
                 "--max-tokens", "4", "--doc-tokens", "40", *[arg for s in sets for arg in ("--set", s)], "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    roles = {row["role"] for row in result["instances"].values()}
    assert roles == {"supervisor", "conductor", "store", "prefill", "decode"}
    run = result["runs"][0]
    assert run["completion_tokens"] == [4, 4]
    assert result["total"]["rss"]["median"] == sum(row["rss"] for row in run["processes"])
    assert result["total"]["pss"]["median"] <= result["total"]["rss"]["median"]
    store = next(row for row in result["instances"].values() if row["role"] == "store")
    assert store["pool_rss"]["median"] == 32 << 20  # the store prefaults its pool
    assert result["weight_bytes_fp32"] > 0 and result["is_worker_within_target"]
