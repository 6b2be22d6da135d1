"""`mooncaked bench model --tp N`: tensor-parallel prefill and decode at TP=N (one thread per rank) vs TP=1 (one
thread), side by side in one run.

Stages:
  1. Load the model whole in this process (TP=1) and start a TensorParallelRunner of N ranks (this process is
     rank 0), both fp32 with plain and MKL-packed projections (plain serves prefill, packed decode, as in a
     prefill and a decode instance). Default model: `random:smollm2-135m-8q4kv` (SmolLM2-135M's size and shape
     with 8 query and 4 KV heads, which 2 ranks can split).
  2. Prefill: one sequence of `--prefill-tokens` tokens. Decode: `--decode-batch` sequences with a
     `--decode-context`-token prefix each (prefilled once, untimed), then `--new-tokens` decode steps feeding
     fixed tokens (the same work on both sides). Greedy tokens of both sides are compared.
  3. TP=1 and TP=N runs alternate in adjacent pairs (`--repeats`, at least 3, order alternating): a speedup is
     the median over pairs of t(TP=1) / t(TP=N), with its min and max, next to the host's load average.
  4. Print the results as JSON (`tp_prefill_speedup`, `tp_decode_speedup`, ...), and write them with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from mooncaked.bench.report import report
from mooncaked.engine.batch import (DecodeBatch, DecodeSeq, PrefillBatch, PrefillSeq, build_decode_batch,
                                    build_prefill_batch)
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.engine.tp.rank import RankSpec
from mooncaked.engine.tp.runner import TensorParallelRunner
from mooncaked.model.loader import load_model

TP_MODEL = "random:smollm2-135m-8q4kv"
TARGET_SPEEDUP = {"prefill": 1.6, "decode": 1.3}  # issue 16, TP=2 on a 2-core CPU

Forward = Callable[[], torch.Tensor]


class Workload:
    """The batches both sides run: a long prefill, a decode context, decode steps; owns its page plan."""

    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        block = args.block_size
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, vocab_size, (args.prefill_tokens,), generator=gen).tolist()
        num_prefill_pages = -(-args.prefill_tokens // block)
        per_seq = -(-(args.decode_context + args.new_tokens) // block)
        prefill_pages = list(range(num_prefill_pages))
        seq_pages = [list(range(num_prefill_pages + i * per_seq, num_prefill_pages + (i + 1) * per_seq))
                     for i in range(args.decode_batch)]
        self.num_pages = num_prefill_pages + args.decode_batch * per_seq
        self.block_size = block

        def batch_of(seqs: list[PrefillSeq]) -> PrefillBatch:
            return build_prefill_batch(seqs, block_size=block, num_pages=self.num_pages, device="cpu")

        self.prefill = batch_of([PrefillSeq(prompt, 0, prefill_pages)])
        contexts = [torch.randint(3, vocab_size, (args.decode_context,), generator=gen).tolist() for _ in seq_pages]
        self.contexts = batch_of([PrefillSeq(c, 0, p) for c, p in zip(contexts, seq_pages)])
        self.decode_steps: list[DecodeBatch] = [
            build_decode_batch([DecodeSeq(3 + (step * 31 + i) % (vocab_size - 3), args.decode_context + step, p)
                                for i, p in enumerate(seq_pages)], block_size=block, num_pages=self.num_pages,
                               device="cpu")
            for step in range(args.new_tokens)]


def _side(prefill: Callable[[PrefillBatch], torch.Tensor], decode: Callable[[DecodeBatch], torch.Tensor],
          work: Workload) -> tuple[Forward, Forward, Callable[[], list[int]]]:
    """(one prefill, all decode steps, the greedy tokens of every decode step). `tokens` first writes the decode
    contexts' KV, which the decode steps then read (each run rewrites the same slots)."""
    def run_decode() -> torch.Tensor:
        logits = torch.empty(0)
        for batch in work.decode_steps:
            logits = decode(batch)
        return logits

    def tokens() -> list[int]:
        prefill(work.contexts)
        return [t for batch in work.decode_steps for t in decode(batch).argmax(-1).tolist()]

    return (lambda: prefill(work.prefill)), run_decode, tokens


def _pairs(single: Forward, parallel: Forward, repeats: int) -> dict[str, float]:
    """Median, min and max over adjacent pairs of t(single) / t(parallel), and the best times."""
    ratios: list[float] = []
    single_s: list[float] = []
    parallel_s: list[float] = []
    for i in range(repeats):
        order = [(single, single_s), (parallel, parallel_s)]
        for fn, times in order if i % 2 == 0 else order[::-1]:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        ratios.append(single_s[-1] / parallel_s[-1])
    return {"speedup": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "tp1_s": min(single_s), "tpn_s": min(parallel_s)}


def run(args: argparse.Namespace) -> int:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # TP=1 runs on one thread; each rank of TP=N too (rank 0 is this process)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace) -> int:
    source = args.model or TP_MODEL
    loaded = load_model(source, dtype="float32", device="cpu", packing="both")
    work = Workload(args, loaded.args.vocab_size)
    kv = KVPages.for_model(loaded.args, num_pages=work.num_pages, block_size=work.block_size, dtype=torch.float32,
                           device="cpu")
    single = ModelRunner(loaded.model, kv)
    spec = RankSpec(source, num_pages=work.num_pages, block_size=work.block_size, packing="both", num_threads=1,
                    timeout_s=600.0)
    tp = TensorParallelRunner.start(spec, args.tp)
    try:
        results = _measure(args, work, single, tp)
    finally:
        tp.stop()
    results.update({"model": source, "tp": args.tp, "prefill_tokens": args.prefill_tokens,
                    "decode_batch": args.decode_batch, "new_tokens": args.new_tokens,
                    "load_average": list(os.getloadavg())})
    report(results, json.dumps(results, indent=2), args.json)
    return 0


def _measure(args: argparse.Namespace, work: Workload, single: ModelRunner,
             tp: TensorParallelRunner) -> dict[str, Any]:
    prefill_1, decode_1, tokens_1 = _side(single.prefill, single.decode, work)
    prefill_n, decode_n, tokens_n = _side(tp.prefill, tp.decode, work)
    expected, got = tokens_1(), tokens_n()  # also the warm-up of both sides
    results: dict[str, Any] = {"tokens_match": sum(a == b for a, b in zip(expected, got)) / len(expected)}
    for name, pair in (("prefill", (prefill_1, prefill_n)), ("decode", (decode_1, decode_n))):
        print(f"{name}: TP=1 vs TP={args.tp} ...", flush=True)
        measured = _pairs(*pair, repeats=max(args.repeats, 3))
        results.update({f"tp_{name}_speedup": measured["speedup"], f"tp_{name}_speedup_min": measured["min"],
                        f"tp_{name}_speedup_max": measured["max"], f"tp_{name}_target": TARGET_SPEEDUP[name],
                        f"tp1_{name}_ms": measured["tp1_s"] * 1e3, f"tp{args.tp}_{name}_ms": measured["tpn_s"] * 1e3})
    return results
