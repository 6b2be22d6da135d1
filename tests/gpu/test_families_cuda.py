"""Every supported family on CUDA: the tiny random checkpoints of tests/model/family_checkpoints.py, loaded on
the device in fp32, through the paged runner with both backends; logits against transformers' on the CPU, and
greedy tokens (torch backend) equal to transformers' argmax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.loader import load_model
from tests.model.family_checkpoints import CASE_IDS, CASES, FamilyCase, write_checkpoint

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

BLOCK, NUM_PAGES = 8, 24
PROMPT = [3 + (7 * i) % 250 for i in range(21)]
STEPS = 8
# fp32 on the device: the torch backend's matmuls are full fp32; Triton's fp32 dots use TF32 (~3e-4 relative)
TOLERANCE = {"torch": 1e-3, "triton": 1e-2}


def _paged_run(runner: ModelRunner) -> tuple[torch.Tensor, list[int]]:
    """Prefill in two chunks (the second over the first's pages), then greedy decode: logits of every position."""
    pages = PageAllocator(runner.kv_pages.num_pages).allocate(runner.kv_pages.num_pages_for(len(PROMPT) + STEPS), "seq")
    split = len(PROMPT) - 8
    chunks = [PrefillSeq(PROMPT[:split], 0, pages), PrefillSeq(PROMPT[split:], split, pages)]
    logits = [runner.prefill(build_prefill_batch([seq], block_size=BLOCK, num_pages=NUM_PAGES, device="cuda"),
                             return_all_logits=True) for seq in chunks]
    tokens = list(PROMPT)
    for _ in range(STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        step = build_decode_batch([DecodeSeq(tokens[-1], len(tokens) - 1, pages)], block_size=BLOCK,
                                  num_pages=NUM_PAGES, device="cuda")
        logits.append(runner.decode(step))
    return torch.cat(logits).float().cpu(), tokens


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_family_on_cuda_matches_transformers(case: FamilyCase, backend: str, tmp_path: Path) -> None:
    hf = write_checkpoint(case, tmp_path, seed=11)
    loaded = load_model(str(tmp_path), dtype="float32", device="cuda")
    kv = KVPages.for_model(loaded.args, num_pages=NUM_PAGES, block_size=BLOCK, dtype=torch.float32, device="cuda")
    logits, tokens = _paged_run(ModelRunner(loaded.model, kv, backend=backend))
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, expected, atol=TOLERANCE[backend], rtol=0)
    if backend == "torch":  # greedy: every generated token is transformers' argmax after the same prefix
        assert tokens[len(PROMPT):] == expected[len(PROMPT) - 1:-1].argmax(-1).tolist()
