"""Tensor parallelism across processes on CPU (gloo): TP=2 gives TP=1's greedy tokens for every family, a rank
that dies or stalls makes rank 0 fail within its deadline, and a degree the heads do not allow starts nothing."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch

from mooncaked.engine.batch import (DecodeBatch, DecodeSeq, PrefillBatch, PrefillSeq, build_decode_batch,
                                    build_prefill_batch)
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.engine.tp.rank import RankSpec
from mooncaked.engine.tp.runner import RankFailed, TensorParallelRunner
from mooncaked.model import tensor_parallel
from mooncaked.model.loader import load_model
from mooncaked.model.tensor_parallel import TensorParallelError
from tests.model.family_checkpoints import CASES, write_checkpoint

pytest.importorskip("transformers")

BLOCK = 8
NUM_PAGES = 16
PROMPT = [3 + (7 * i) % 250 for i in range(21)]
NEW_TOKENS = 6
# one case per family, plus row-parallel biases (llama) and fewer KV heads (1) than ranks (mistral: replicated)
TP_CASES = ["llama3.1-untied-rope-llama3", "llama-attention-and-mlp-bias", "mistral-sliding-window",
            "qwen2.5-qkv-bias-tied", "qwen3-qk-norm-tied"]

PrefillFn = Callable[[PrefillBatch], torch.Tensor]
DecodeFn = Callable[[DecodeBatch], torch.Tensor]


def _greedy(prefill: PrefillFn, decode: DecodeFn) -> tuple[list[int], torch.Tensor]:
    """Prefill PROMPT in two chunks, then greedy decode: the new tokens and every step's logits."""
    pages = PageAllocator(NUM_PAGES).allocate(-(-(len(PROMPT) + NEW_TOKENS) // BLOCK), "seq")
    split = len(PROMPT) - 8
    chunks = [PrefillSeq(PROMPT[:split], 0, pages), PrefillSeq(PROMPT[split:], split, pages)]
    logits = [prefill(build_prefill_batch([c], block_size=BLOCK, num_pages=NUM_PAGES, device="cpu")) for c in chunks]
    tokens: list[int] = []
    for _ in range(NEW_TOKENS):
        tokens.append(int(logits[-1][-1].argmax()))
        seq = DecodeSeq(tokens[-1], len(PROMPT) + len(tokens) - 1, pages)
        logits.append(decode(build_decode_batch([seq], block_size=BLOCK, num_pages=NUM_PAGES, device="cpu")))
    return tokens, torch.cat(logits)


def _pid(process: BaseProcess) -> int:
    assert process.pid is not None
    return process.pid


@pytest.fixture
def started() -> Iterator[list[TensorParallelRunner]]:
    """Runners a test starts; each is stopped at the end, whatever the test did to its ranks."""
    runners: list[TensorParallelRunner] = []
    yield runners
    for runner in runners:
        for process in runner.processes:
            if process.is_alive():
                os.kill(_pid(process), signal.SIGCONT)
        runner.stop()


@pytest.mark.parametrize("case_id, slot_bytes, vocab_size, is_expert_parallel", [
    *[(case_id, 8 << 20, 320, False) for case_id in TP_CASES],
    ("mistral-sliding-window", 0, 320, False), ("qwen2.5-qkv-bias-tied", 1024, 320, False),
    ("llama3.1-untied-rope-llama3", 8 << 20, 321, False), ("qwen3-qk-norm-tied", 0, 321, False),
    ("qwen3-moe-mlp-only-layer", 8 << 20, 320, False), ("qwen3-moe-mlp-only-layer", 8 << 20, 320, True),
    ("deepseek-v3-mla-yarn-grouped-experts", 8 << 20, 320, False),
    ("deepseek-v3-mla-yarn-grouped-experts", 8 << 20, 320, True)],
    ids=TP_CASES + ["mistral-gloo-only", "qwen2.5-prefill-gloo-decode-shared-memory",
                    "llama3.1-replicated-head", "qwen3-tied-replicated-head-gloo-only",
                    "qwen3-moe-experts-column-sharded", "qwen3-moe-expert-parallel",
                    "deepseek-v3-mla-heads-split-latent-replicated", "deepseek-v3-expert-parallel"])
def test_tp2_gives_the_tokens_of_tp1(case_id: str, slot_bytes: int, vocab_size: int, is_expert_parallel: bool,
                                     tmp_path: Path, started: list[TensorParallelRunner]) -> None:
    """All-reduces through shared memory, through gloo only, or both (prefill rows do not fit 1 KiB slots); the
    output head split by vocabulary rows (320) or, where 2 does not divide the vocabulary (321), replicated; a MoE
    model's experts column-sharded or, expert-parallel, 4 whole experts per rank; an MLA model's query heads split,
    its latent (one KV "head") replicated on both ranks."""
    case = next(c for c in CASES if c.case_id == case_id)
    write_checkpoint(replace(case, config={**case.config, "vocab_size": vocab_size}), tmp_path, seed=7)
    loaded = load_model(str(tmp_path), packing="plain")
    kv = KVPages.for_model(loaded.args, num_pages=NUM_PAGES, block_size=BLOCK, dtype=torch.float32, device="cpu")
    single = ModelRunner(loaded.model, kv, backend="torch")
    expected_tokens, expected_logits = _greedy(lambda b: single.prefill(b, return_all_logits=True), single.decode)
    spec = RankSpec(str(tmp_path), num_pages=NUM_PAGES, block_size=BLOCK, backend="torch", timeout_s=60.0,
                    allreduce_slot_bytes=slot_bytes, is_expert_parallel=is_expert_parallel)
    started.append(tp := TensorParallelRunner.start(spec, 2))
    if loaded.args.moe is not None:
        expected_experts = loaded.args.moe.num_experts // 2 if is_expert_parallel else loaded.args.moe.num_experts
        assert tp.model.shape.num_experts == expected_experts
    assert tp.shard is not None and tp.shard.kv_pages.num_kv_heads == max(1, loaded.args.num_kv_heads // 2)
    assert (tp.reducer is not None) == (slot_bytes > 0)
    assert tp.model.shape.vocab_size == (None if vocab_size % 2 else vocab_size // 2)
    tokens, logits = _greedy(lambda b: tp.prefill(b, return_all_logits=True), tp.decode)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)


def test_tp2_over_compressed_pages_gives_the_tokens_of_tp1(started: list[TensorParallelRunner]) -> None:
    """Each rank quantizes its own KV heads' rows (one scale per token and head): the same rows as one process's
    (fp8_e4m3 pages, the other packed format, take the same path: tests/kernels/test_quantized_kv.py)."""
    cache_dtype = "int8"
    loaded = load_model("random:tiny", packing="plain")
    kv = KVPages.for_model(loaded.args, num_pages=NUM_PAGES, block_size=BLOCK, dtype=torch.float32, device="cpu",
                           cache_dtype=cache_dtype)
    single = ModelRunner(loaded.model, kv, backend="torch")
    expected_tokens, expected_logits = _greedy(lambda b: single.prefill(b, return_all_logits=True), single.decode)
    spec = RankSpec("random:tiny", num_pages=NUM_PAGES, block_size=BLOCK, backend="torch", timeout_s=60.0,
                    cache_dtype=cache_dtype)
    started.append(tp := TensorParallelRunner.start(spec, 2))
    assert tp.shard is not None and tp.shard.kv_pages.row_width == loaded.args.kv_head_dim + 2
    tokens, logits = _greedy(lambda b: tp.prefill(b, return_all_logits=True), tp.decode)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)


def test_a_degree_the_heads_do_not_allow_starts_no_rank(started: list[TensorParallelRunner]) -> None:
    spec = RankSpec("random:smollm2-135m", num_pages=4, block_size=BLOCK)
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size 2 .*9 query heads, 3 KV heads"):
        TensorParallelRunner.start(spec, 2)
    assert not tensor_parallel.has_group()


def test_a_degree_past_the_hosts_cuda_devices_starts_no_rank(started: list[TensorParallelRunner]) -> None:
    num_ranks = torch.cuda.device_count() + 1  # one more rank than devices, with or without a GPU
    spec = RankSpec("random:tiny", num_pages=4, block_size=BLOCK, device="cuda")
    with pytest.raises(TensorParallelError, match=rf"tensor_parallel_size {num_ranks} on cuda needs CUDA devices "
                                                  rf"cuda:0..cuda:{num_ranks - 1}, one per rank; this host has "
                                                  rf"{num_ranks - 1}"):
        TensorParallelRunner.start(spec, num_ranks)
    assert not tensor_parallel.has_group()


def _tiny_group(started: list[TensorParallelRunner], timeout_s: float) -> TensorParallelRunner:
    spec = RankSpec("random:tiny", num_pages=NUM_PAGES, block_size=BLOCK, backend="torch", timeout_s=timeout_s)
    started.append(runner := TensorParallelRunner.start(spec, 2))
    return runner


def _one_prefill(runner: TensorParallelRunner) -> torch.Tensor:
    batch = build_prefill_batch([PrefillSeq(PROMPT, 0, [0, 1, 2])], block_size=BLOCK, num_pages=NUM_PAGES,
                                device="cpu")
    return runner.prefill(batch)


def test_a_killed_rank_fails_rank_0_and_every_later_step(started: list[TensorParallelRunner]) -> None:
    runner = _tiny_group(started, timeout_s=10.0)
    _one_prefill(runner)
    os.kill(_pid(runner.processes[0]), signal.SIGKILL)
    begin = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1"):  # seen dead before the step, or its collective fails
        _one_prefill(runner)
    assert time.monotonic() - begin < 10.0
    with pytest.raises(RankFailed, match="group is down"):
        _one_prefill(runner)


def test_a_stalled_rank_fails_rank_0_within_the_deadline(started: list[TensorParallelRunner]) -> None:
    runner = _tiny_group(started, timeout_s=3.0)
    _one_prefill(runner)
    os.kill(_pid(runner.processes[0]), signal.SIGSTOP)
    begin = time.monotonic()
    with pytest.raises(RankFailed):
        _one_prefill(runner)
    assert 2.5 < time.monotonic() - begin < 3.0 + 5.0
