"""`mooncaked bench model`: CPU greedy decode, ours vs transformers `generate`, plus layer-callback overhead
(`--tp N`: tensor-parallel speedups instead, bench.model_tp; `--model moe`: a MoE model, bench.model_moe).

Stages:
  1. Load our model (fp32) with the projections a decode instance keeps (`--packing`, default `packed`: the
     MKL-packed copies in place of the plain ones) and build a transformers LlamaForCausalLM with the very same
     weights (unfused from a plain load of ours), set torch to `--threads` intra-op threads.
  2. Render the same chat prompts for both; generate exactly `--new-tokens` tokens per sequence, greedy, EOS
     suppressed on both sides (transformers: min_new_tokens = max_new_tokens), at each batch size
     (transformers left-padded). Runs alternate ours / transformers, the best of `--repeats` counts.
     tok/s = batch * new tokens / wall time of the whole generation (prefill included on both sides);
     cpu_ratio_* compares process CPU time instead (steadier on a shared host).
  3. Prefill `--prefill-tokens` tokens with no-op before/after layer callbacks vs none, in adjacent pairs (the
     order alternating); callback_overhead = median over pairs of (with / without) - 1 (pairs share the host's
     load of the moment).
  4. Print a table; write JSON with `--json`.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mooncaked.bench import model_moe, model_tp
from mooncaked.bench.decode_compare import OursGenerator, Timing, chat_prompts, measure_decode
from mooncaked.bench.report import write_json
from mooncaked.engine.batch import PrefillSeq, build_prefill_batch
from mooncaked.model.frontend import EMBEDDED_SMOLLM2
from mooncaked.model.hf_config import to_hf_config
from mooncaked.model.llama import LlamaDecoderLayer, LlamaForCausalLM, Linear
from mooncaked.model.loader import LoadedModel, load_model
from mooncaked.model.packed_gemm import PACKINGS

TARGET_RATIO = {1: 1.1, 8: 1.5}
TARGET_CALLBACK_OVERHEAD = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    parser.add_argument("--model", default=None, help="model source (loader syntax), or `moe`: a small MoE model "
                        "against transformers and a dense model of equal active parameters (bench.model_moe); "
                        f"default: embedded:smollm2, with --tp > 1 {model_tp.TP_MODEL}")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (with --tp: 1 per side)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--prefill-tokens", type=int, default=1024, help="prompt length for callback overhead")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side and setting (best counts)")
    parser.add_argument("--packing", choices=PACKINGS, default="packed",
                        help="projection copies ours keeps: packed (a decode instance), both (a switchable one), "
                             "plain (a prefill one)")
    parser.add_argument("--tp", type=int, default=1, help="> 1: tensor-parallel prefill and decode at this degree "
                        "(one thread per rank) vs TP=1 (one thread) instead (bench.model_tp)")
    parser.add_argument("--decode-batch", type=int, default=8, help="with --tp: sequences per decode step")
    parser.add_argument("--decode-context", type=int, default=64, help="with --tp: tokens before the first step")


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our fused, transposed weights split back into Hugging Face names and layout."""
    args = model.args
    assert model.embed_tokens is not None and model.norm is not None and model.lm_head is not None
    state = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not args.tie_word_embeddings:
        state["lm_head.weight"] = _dense(model.lm_head)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        assert layer.gate_up_proj is not None and layer.down_proj is not None and layer.qkv_proj is not None, (
            "a dense GQA model's layers")
        p = f"model.layers.{i}."
        q, k, v = _dense(layer.qkv_proj).split([args.q_size, args.kv_size, args.kv_size])
        gate, up = _dense(layer.gate_up_proj).split(args.intermediate_size)
        state.update({
            p + "input_layernorm.weight": layer.input_layernorm.weight,
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": _dense(layer.o_proj),
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": _dense(layer.down_proj),
        })
    return {name: t.detach().contiguous().clone() for name, t in state.items()}


def _dense(linear: Linear) -> torch.Tensor:
    """The projection's weight [out, in] (a model loaded with plain projections)."""
    if linear.weight_t is None:
        raise ValueError("the transformers copy needs a model loaded with plain projections (packing plain or both)")
    return linear.weight_t.t()


def build_hf_model(loaded: LoadedModel) -> Any:
    import transformers

    config = transformers.LlamaConfig(**to_hf_config(loaded.args))
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.load_state_dict(hf_state_dict(loaded.model), strict=False)
    return hf


def measure_callbacks(loaded: LoadedModel, ours: OursGenerator, num_tokens: int, repeats: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, loaded.args.vocab_size, (num_tokens,), generator=gen).tolist()
    kv = ours.kv
    pages = ours.pages.allocate(kv.num_pages_for(num_tokens), "bench-prefill")
    batch = build_prefill_batch([PrefillSeq(prompt, 0, pages)], block_size=kv.block_size,
                                num_pages=kv.num_pages, device="cpu")

    def noop(layer: int) -> None:
        return None

    ratios: list[float] = []
    plain, hooked = Timing(), Timing()

    def run_plain() -> float:
        return plain.add(lambda: ours.runner.prefill(batch))

    def run_hooked() -> float:
        return hooked.add(lambda: ours.runner.prefill(batch, before_layer=noop, after_layer=noop))

    try:
        ours.runner.prefill(batch)  # warm-up
        for i in range(repeats):  # adjacent pairs share the machine's load; the order alternates (no order bias)
            if i % 2 == 0:
                without_s, with_s = run_plain(), run_hooked()
            else:
                with_s, without_s = run_hooked(), run_plain()
            ratios.append(with_s / without_s)
    finally:
        ours.pages.free_owner("bench-prefill")
    return {"prefill_tokens": num_tokens, "prefill_ms_no_callbacks": plain.wall_s * 1e3,
            "prefill_ms_callbacks": hooked.wall_s * 1e3, "callback_overhead": statistics.median(ratios) - 1.0,
            "callback_overhead_best": hooked.wall_s / plain.wall_s - 1.0,
            "callback_overhead_cpu": hooked.cpu_s / plain.cpu_s - 1.0}


def run(args: argparse.Namespace) -> int:
    if args.tp > 1:
        return model_tp.run(args)
    if args.model is None:
        args.model = EMBEDDED_SMOLLM2
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace) -> int:
    if args.model == "moe":
        return model_moe.run(args)
    hf = build_hf_model(load_model(args.model, dtype="float32", device="cpu", packing="plain"))
    loaded = load_model(args.model, dtype="float32", device="cpu", packing=args.packing)
    longest = max(len(p) for p in chat_prompts(loaded, max(args.batch_sizes)))
    num_pages = max(args.batch_sizes) * ((longest + args.new_tokens) // args.block_size + 1) + (
        args.prefill_tokens // args.block_size + 1)
    ours = OursGenerator(loaded, num_pages, args.block_size)
    results: dict[str, Any] = {"model": loaded.model_id, "threads": args.threads, "new_tokens": args.new_tokens,
                               "dtype": "float32", "packing": args.packing}
    for batch_size in args.batch_sizes:
        print(f"decode batch {batch_size} ...", flush=True)
        results.update(measure_decode(loaded, ours, hf, batch_size, args.new_tokens, args.repeats))
    print(f"prefill {args.prefill_tokens} tokens, callbacks ...", flush=True)
    results.update(measure_callbacks(loaded, ours, args.prefill_tokens, max(2 * args.repeats + 1, 8)))
    _print_table(results, args.batch_sizes)
    if args.json is not None:
        write_json(args.json, results)
    return 0


def _print_table(results: dict[str, Any], batch_sizes: Sequence[int]) -> None:
    print(f"\nmodel {results['model']}, fp32, {results['packing']} projections, {results['threads']} threads, "
          f"{results['new_tokens']} new tokens")
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6} {'cpu ratio':>9} {'target':>7} "
          f"{'same tokens':>12}")
    for b in batch_sizes:
        target = TARGET_RATIO.get(b)
        print(f"{b:>5} {results[f'ours_tok_s_b{b}']:>11.1f} {results[f'hf_tok_s_b{b}']:>9.1f} "
              f"{results[f'ratio_b{b}']:>6.2f} {results[f'cpu_ratio_b{b}']:>9.2f} "
              f"{'' if target is None else f'>= {target}':>7} "
              f"{results[f'tokens_match_b{b}']:>12.0%}")
    print(f"prefill {results['prefill_tokens']} tokens: {results['prefill_ms_no_callbacks']:.1f} ms without "
          f"callbacks, {results['prefill_ms_callbacks']:.1f} ms with; overhead "
          f"{results['callback_overhead']:+.2%} (cpu time {results['callback_overhead_cpu']:+.2%}; "
          f"target <= {TARGET_CALLBACK_OVERHEAD:.0%})")
