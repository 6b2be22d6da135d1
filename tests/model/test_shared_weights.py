"""Weights held once: mapped from the host's weight file (shared between processes), packed copies in place of
the plain projections on decode, outputs unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.model import packed_gemm
from mooncaked.model.llama import Linear
from mooncaked.model.loader import LoadedModel, clear_model_cache, load_model
from tests.model.family_checkpoints import CASES, write_checkpoint

pytest.importorskip("transformers")
TIED, UNTIED = (next(c for c in CASES if c.case_id == name) for name in ("llama3.2-tied", "llama-attention-and-mlp-bias"))


def _logits(loaded: LoadedModel, num_prompt: int, num_steps: int) -> list[torch.Tensor]:
    """Prefill logits of a `num_prompt`-token prompt (more rows than PACKED_MAX_ROWS), then decode steps."""
    block_size, num_pages = 16, (num_prompt + num_steps) // 16 + 1
    kv = KVPages.for_model(loaded.args, num_pages=num_pages, block_size=block_size, dtype=loaded.dtype, device="cpu")
    runner, pages = ModelRunner(loaded.model, kv), list(range(num_pages))
    prompt = [(7 * i + 3) % loaded.args.vocab_size for i in range(num_prompt)]
    outputs = [runner.prefill(build_prefill_batch([PrefillSeq(prompt, 0, pages)], block_size=block_size,
                                                  num_pages=num_pages, device="cpu"))]
    for step in range(num_steps):
        token = int(outputs[-1][0].argmax())
        outputs.append(runner.decode(build_decode_batch([DecodeSeq(token, num_prompt + step, pages)],
                                                        block_size=block_size, num_pages=num_pages, device="cpu")))
    return outputs


@pytest.mark.parametrize("case", [TIED, UNTIED], ids=lambda c: c.case_id)
def test_mapped_weights_and_each_packing_give_the_private_models_outputs(case: object, tmp_path: Path) -> None:
    model_dir, cache = tmp_path / "ckpt", tmp_path / "cache"
    write_checkpoint(case, model_dir, seed=3)  # type: ignore[arg-type]
    clear_model_cache()
    expected = _logits(load_model(str(model_dir), cpu_packed_gemm=False), 100, 3)
    for packing in ("plain", "packed", "both"):
        loaded = load_model(str(model_dir), packing=packing, weight_cache_dir=cache)  # type: ignore[arg-type]
        for got, want in zip(_logits(loaded, 100, 3), expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
        if packing == "packed" and packed_gemm.is_available():
            assert all(m.weight_t is None for m in linears)  # held once: packed only
            assert loaded.model.weight_nbytes()["packed"] > loaded.model.weight_nbytes()["plain"]
        if packing == "plain":
            assert all(m.packed is None and m.weight_t is not None for m in linears)
    assert [p.suffix for p in cache.iterdir() if not p.name.startswith(".")] == [".weights"]  # one, for every packing


def test_a_weight_cache_that_cannot_be_written_falls_back_to_private_memory(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    model_dir, blocker = tmp_path / "ckpt", tmp_path / "not-a-dir"
    write_checkpoint(TIED, model_dir, seed=4)
    blocker.write_text("a file where the cache directory should be")
    clear_model_cache()
    loaded = load_model(str(model_dir), packing="plain", weight_cache_dir=blocker / "weights")
    assert "holding them in this process's private memory" in caplog.text
    torch.testing.assert_close(_logits(loaded, 20, 1)[0],
                               _logits(load_model(str(model_dir), cpu_packed_gemm=False), 20, 1)[0])


_PROCESS = """
import json, sys
from tests.model.test_shared_weights import _logits
from mooncaked.model.loader import load_model
loaded = load_model(sys.argv[1], packing=sys.argv[2], weight_cache_dir=sys.argv[3])
_logits(loaded, 100, 1)  # touch every weight
mappings, current = [], None
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
        current = {"size": 0, "rss": 0, "shared": 0} if fields[-1].endswith(".weights") else None
        if current is not None:
            mappings.append(current)
    elif current is not None and fields[0] in ("Size:", "Rss:", "Shared_Clean:"):
        current[{"Size:": "size", "Rss:": "rss", "Shared_Clean:": "shared"}[fields[0]]] = int(fields[1]) * 1024
print(json.dumps(mappings), flush=True)
sys.stdin.readline()  # stay alive (keeping the mapping) until the test is done
"""


def _spawn(model_dir: Path, packing: str, cache: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _PROCESS, str(model_dir), packing, str(cache)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _mappings(process: subprocess.Popen[str]) -> list[dict[str, int]]:
    assert process.stdout is not None
    line = process.stdout.readline()  # the child answers within its own load time; it dies with the test otherwise
    assert line, f"the child exited with {process.wait(timeout=30)}"
    return json.loads(line)  # type: ignore[no-any-return]


@pytest.mark.skipif(not packed_gemm.is_available(), reason="needs MKL's packed GEMM (decode drops plain weights)")
def test_processes_on_one_host_share_the_weight_pages(tmp_path: Path) -> None:
    """A prefill-like process and a second one map the same file pages (each sees them shared); a decode-like
    process maps only the resident section: its projections are packed copies, the file's pages unmapped."""
    model_dir, cache = tmp_path / "ckpt", tmp_path / "cache"
    write_checkpoint(UNTIED, model_dir, seed=5)
    processes = [_spawn(model_dir, "plain", cache)]
    try:
        first_maps = _mappings(processes[0])  # it wrote the file; the other two start together and map it
        processes += [_spawn(model_dir, "plain", cache), _spawn(model_dir, "packed", cache)]
        second_maps, decode_maps = _mappings(processes[1]), _mappings(processes[2])
    finally:
        for process in processes:
            process.communicate("\n", timeout=30)
    assert len(first_maps) == len(second_maps) == 2  # resident and projections sections
    assert all(m["rss"] > 0 and m["shared"] == m["rss"] for m in second_maps)  # every page it holds is shared
    assert len(decode_maps) == 1 and decode_maps[0]["size"] == min(m["size"] for m in first_maps)
