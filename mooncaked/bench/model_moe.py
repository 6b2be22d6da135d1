"""`mooncaked bench model --model moe`: CPU greedy decode of a small MoE model, ours vs transformers' own Qwen3-MoE
implementation of the same checkpoint, and ours beside a dense model of the same active parameters.

Stages:
  1. The MoE model is `random:moe-512` (Qwen3-MoE-shaped: hidden 512, 4 layers, 16 experts of 192 columns,
     top-4), the dense one `random:moe-512-dense` (one MLP of 4 x 192 columns: the same active parameters, less the
     router). Ours loads both fp32 with `--packing` projections; the MoE weights are also written as a Hugging Face
     checkpoint (config.json and safetensors, per-expert tensors) into a temporary directory, which transformers
     loads with `from_pretrained` (its CPU experts implementation as it chooses by default).
  2. Decode at each batch size exactly as `bench model` does (bench.decode_compare.measure_decode: chat prompts, EOS
     suppressed on both sides, prefill included, runs alternating, best of `--repeats`): `ours_tok_s_bN`,
     `hf_tok_s_bN`, `ratio_bN`, `tokens_match_bN`.
  3. Decode steps alone (the same prompts prefilled untimed, then `--new-tokens` steps) on ours for the MoE and
     the dense model, alternating, best of `--repeats`: `moe_active_cost_ratio_bN` = MoE step time / dense step time
     (`moe_active_cost_ratio` is batch 1's; `..._cpu_ratio_bN` the same in process CPU time, steadier on a
     shared host), `moe_step_ms_bN`, `dense_step_ms_bN`.
  4. Print a table and the host's load average (and whether kernels/cpu_moe's C kernel ran the decode steps'
     experts: `cpu_moe_kernel`); write JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mooncaked.bench.decode_compare import OursGenerator, Timing, chat_prompts, measure_decode
from mooncaked.bench.report import report
from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.kernels import cpu_moe
from mooncaked.model.config import ModelArgs
from mooncaked.model.hf_config import to_hf_config
from mooncaked.model.loader import LoadedModel, load_model
from mooncaked.model.weight_names import random_hf_state_dict

MOE_MODEL, DENSE_MODEL = "random:moe-512", "random:moe-512-dense"
TARGET_RATIO_B8 = 1.5  # ours / transformers tok/s at batch 8 (issue 30)
TARGET_ACTIVE_COST_B1 = 1.3  # MoE step / dense step of equal active parameters at batch 1


def write_hf_checkpoint(args: ModelArgs, seed: int, path: Path) -> None:
    """The seeded random weights `random:` models load, as a checkpoint transformers reads."""
    config = to_hf_config(args)
    config["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in random_hf_state_dict(args, seed).items()},
              str(path / "model.safetensors"))


def load_hf_model(args: ModelArgs, seed: int) -> Any:
    import transformers

    with tempfile.TemporaryDirectory(prefix="mooncaked-bench-moe-") as directory:
        write_hf_checkpoint(args, seed, Path(directory))
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def decode_steps(gen: OursGenerator, prompts: list[list[int]], num_steps: int) -> Timing:
    """Prefill `prompts` (untimed), then time `num_steps` greedy decode steps of the whole batch."""
    kv, block = gen.kv, gen.kv.block_size
    pages = [gen.pages.allocate(kv.num_pages_for(len(p) + num_steps), f"steps-{i}") for i, p in enumerate(prompts)]
    try:
        logits = gen.runner.prefill(build_prefill_batch([PrefillSeq(p, 0, pg) for p, pg in zip(prompts, pages)],
                                                        block_size=block, num_pages=kv.num_pages, device="cpu"))
        lengths = [len(p) for p in prompts]
        timing = Timing()

        def steps() -> None:
            nonlocal logits
            for step in range(num_steps):
                tokens = logits.argmax(dim=-1).tolist()
                seqs = [DecodeSeq(t, n + step, pg) for t, n, pg in zip(tokens, lengths, pages)]
                logits = gen.runner.decode(build_decode_batch(seqs, block_size=block, num_pages=kv.num_pages,
                                                              device="cpu"))

        timing.add(steps)
        return timing
    finally:
        for i in range(len(prompts)):
            gen.pages.free_owner(f"steps-{i}")


def measure_active_cost(moe: OursGenerator, dense: OursGenerator, prompts: list[list[int]], num_steps: int,
                        repeats: int) -> dict[str, float]:
    """MoE decode step time / dense one (best of `repeats`, runs alternating), wall and CPU time."""
    moe_t, dense_t = Timing(), Timing()
    for _ in range(repeats + 1):  # the first pair warms up
        for gen, timing in ((moe, moe_t), (dense, dense_t)):
            run = decode_steps(gen, prompts, num_steps)
            timing.wall_s, timing.cpu_s = min(timing.wall_s, run.wall_s), min(timing.cpu_s, run.cpu_s)
    b = len(prompts)
    return {f"moe_step_ms_b{b}": moe_t.wall_s / num_steps * 1e3, f"dense_step_ms_b{b}": dense_t.wall_s / num_steps * 1e3,
            f"moe_active_cost_ratio_b{b}": moe_t.wall_s / dense_t.wall_s,
            f"moe_active_cost_cpu_ratio_b{b}": moe_t.cpu_s / dense_t.cpu_s}


def run(args: argparse.Namespace) -> int:
    moe = load_model(MOE_MODEL, dtype="float32", device="cpu", packing=args.packing)
    dense = load_model(DENSE_MODEL, dtype="float32", device="cpu", packing=args.packing)
    hf = load_hf_model(moe.args, seed=0)
    num_pages = _num_pages(moe, args)
    ours_moe = OursGenerator(moe, num_pages, args.block_size)
    ours_dense = OursGenerator(dense, num_pages, args.block_size)
    results: dict[str, Any] = {"model": MOE_MODEL, "dense_model": DENSE_MODEL, "threads": args.threads,
                               "new_tokens": args.new_tokens, "dtype": "float32", "packing": args.packing,
                               "cpu_moe_kernel": cpu_moe.load() is not None
                               and torch.get_num_threads() <= cpu_moe.MAX_THREADS}
    for batch_size in args.batch_sizes:
        print(f"decode batch {batch_size} ...", flush=True)
        results.update(measure_decode(moe, ours_moe, hf, batch_size, args.new_tokens, args.repeats))
        results.update(measure_active_cost(ours_moe, ours_dense, chat_prompts(moe, batch_size), args.new_tokens,
                                           args.repeats))
    if 1 in args.batch_sizes:
        results["moe_active_cost_ratio"] = results["moe_active_cost_ratio_b1"]
    results["load_average"] = os.getloadavg()
    report(results, _table(results, args.batch_sizes), args.json)
    return 0


def _num_pages(loaded: LoadedModel, args: argparse.Namespace) -> int:
    longest = max(len(p) for p in chat_prompts(loaded, max(args.batch_sizes)))
    return max(args.batch_sizes) * ((longest + args.new_tokens) // args.block_size + 1)


def _table(results: dict[str, Any], batch_sizes: list[int]) -> str:
    lines = [f"\n{results['model']} vs transformers (same checkpoint) and vs {results['dense_model']} (same active "
             f"parameters), fp32, {results['packing']} projections, {results['threads']} threads, "
             f"CPU MoE kernel {'on' if results['cpu_moe_kernel'] else 'off (torch experts)'}, "
             f"{results['new_tokens']} new tokens",
             f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6} {'cpu ratio':>9} {'same tokens':>12} "
             f"{'moe ms/step':>12} {'dense ms/step':>14} {'moe/dense':>10} {'(cpu)':>6}"]
    for b in batch_sizes:
        lines.append(f"{b:>5} {results[f'ours_tok_s_b{b}']:>11.1f} {results[f'hf_tok_s_b{b}']:>9.1f} "
                     f"{results[f'ratio_b{b}']:>6.2f} {results[f'cpu_ratio_b{b}']:>9.2f} "
                     f"{results[f'tokens_match_b{b}']:>12.0%} {results[f'moe_step_ms_b{b}']:>12.2f} "
                     f"{results[f'dense_step_ms_b{b}']:>14.2f} {results[f'moe_active_cost_ratio_b{b}']:>10.2f} "
                     f"{results[f'moe_active_cost_cpu_ratio_b{b}']:>6.2f}")
    lines.append(f"targets: ratio_b8 >= {TARGET_RATIO_B8}, moe_active_cost_ratio (batch 1) <= {TARGET_ACTIVE_COST_B1};"
                 f" load average {' '.join(f'{x:.2f}' for x in results['load_average'])}")
    return "\n".join(lines)
