"""`mooncaked bench kernels`: the Triton attention kernels on a CUDA GPU.

Stages:
  1. Refuse without a CUDA device (exit code 2): the interpreter says nothing about GPU speed.
  2. Prefill: ours over shuffled paged K/V vs torch SDPA over dense, contiguous K/V already expanded to all
     query heads (SDPA's fastest path: flash attention, no GQA or paging cost), causal, with no prefix and
     with a 50% cached prefix (SDPA gets the bottom-right causal bias). ratio = sdpa_ms / ours_ms.
  3. Decode: achieved bandwidth = K/V bytes read / time of a CUDA-graph replay (as the runner runs decode steps;
     the eager time, host launch cost included, beside it), as a fraction of the device's peak.
  4. Print both tables; write JSON with --json. Each result also carries its max abs error against a baseline.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from triton.runtime.errors import OutOfResources

from mooncaked import kernels
from mooncaked.bench.report import write_json
from mooncaked.kernels import triton_prefill

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Spec HBM bandwidth in bytes/s by device-name fragment (first match wins); others use clock * bus width.
PEAK_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
PREFILL_TARGET = 0.8
DECODE_TARGET = 0.7


@dataclass(frozen=True)
class Setup:
    """What every measurement shares: model shape, page size, device, and the timer (ms per call)."""

    device: torch.device
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    time_ms: Callable[[Callable[[], torch.Tensor]], float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV page")
    parser.add_argument("--prefill-tokens", type=_int_list, default=[4096, 8192, 16384, 32768])
    parser.add_argument("--decode-batches", type=_int_list, default=[1, 4, 16, 64])
    parser.add_argument("--decode-contexts", type=_int_list, default=[4096, 8192, 16384, 32768])
    parser.add_argument("--rep-ms", type=int, default=200, help="timing window per measurement")
    parser.add_argument("--prefill-tiles", type=_tiles_list, default=[],
                        help="prefill tile shapes to compare, BLOCK_MxBLOCK_NxWARPSxSTAGES, comma-separated "
                             "(e.g. 128x64x8x3,128x128x8x3); default: the kernel's own choice")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("mooncaked bench kernels needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    setup = Setup(
        device=torch.device("cuda"), dtype=DTYPES[args.dtype], heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, block_size=args.block_size, time_ms=lambda fn: _time_ms(fn, args.rep_ms),
    )
    device = torch.cuda.get_device_name()
    peak = peak_bandwidth()
    prefill = [row for tiles in args.prefill_tiles or [None] for n in args.prefill_tokens for fraction in (0.0, 0.5)
               for row in _fitting(bench_prefill, setup, n, fraction, tiles)]
    if not prefill:
        print("no prefill tile shape fits this device", file=sys.stderr)
        return 2
    decode = [bench_decode(setup, b, c) for b in args.decode_batches for c in args.decode_contexts]
    for row in decode:
        row["fraction_of_peak"] = row["bandwidth_gb_s"] * 1e9 / peak
    _print_tables(device, peak, prefill, decode)
    if args.json is not None:
        result = {
            "device": device,
            "peak_bandwidth_gb_s": peak / 1e9,
            "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                      "block_size": args.block_size, "dtype": args.dtype},
            "prefill": prefill,
            "decode": decode,
            "prefill_min_ratio": min(row["ratio"] for row in prefill),
            "decode_max_fraction_of_peak": max(row["fraction_of_peak"] for row in decode),
        }
        write_json(args.json, result)
    return 0


def peak_bandwidth() -> float:
    """The current CUDA device's peak memory bandwidth in bytes/s."""
    name = torch.cuda.get_device_name()
    for fragment, bandwidth in PEAK_BANDWIDTH:
        if fragment in name:
            return bandwidth
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    # memory_clock_rate is in kHz; double data rate; bus width in bits.
    return 2.0 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8


def bench_prefill(setup: Setup, seq_len: int, prefix_fraction: float,
                  tiles: triton_prefill.PrefillTiles | None = None) -> dict[str, Any]:
    """One sequence of seq_len tokens, the first prefix_fraction of them already cached in pages; `tiles`:
    the kernel's tile shape (None: its default)."""
    heads, kv_heads, head_dim, device = setup.heads, setup.kv_heads, setup.head_dim, setup.device
    num_cached = int(seq_len * prefix_fraction)
    num_new = seq_len - num_cached
    q = torch.randn(num_new, heads, head_dim, device=device, dtype=setup.dtype)
    k = torch.randn(seq_len, kv_heads, head_dim, device=device, dtype=setup.dtype)
    v = torch.randn_like(k)
    k_pages, v_pages, block_tables = paged_kv(k.unsqueeze(0), v.unsqueeze(0), setup.block_size)
    cu_seqlens_q = torch.tensor([0, num_new], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    def ours() -> torch.Tensor:
        if tiles is not None:
            return triton_prefill.prefill_attention(q, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens,
                                                    scale, tiles=tiles)
        return kernels.prefill_attention(
            q, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, scale, backend="triton"
        )

    group = heads // kv_heads
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, n, D]
    k4 = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, L, D]
    v4 = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    mask = causal_lower_right(num_new, seq_len) if num_cached else None

    def sdpa() -> torch.Tensor:
        if mask is None:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)

    error = (ours().float() - sdpa().squeeze(0).transpose(0, 1).float()).abs().max().item()
    ours_ms, sdpa_ms = setup.time_ms(ours), setup.time_ms(sdpa)
    visible_pairs = num_new * num_cached + num_new * (num_new + 1) / 2
    return {
        "tiles": _tiles_name(tiles), "tokens": seq_len, "num_cached": num_cached, "num_new": num_new,
        "ours_ms": ours_ms, "sdpa_ms": sdpa_ms, "ratio": sdpa_ms / ours_ms,
        "ours_tflops": 4 * heads * head_dim * visible_pairs / (ours_ms * 1e-3) / 1e12,
        "max_abs_err_vs_sdpa": error,
    }


def bench_decode(setup: Setup, batch: int, context: int) -> dict[str, Any]:
    """batch sequences of context tokens each, one new query token per sequence."""
    heads, kv_heads, head_dim, device = setup.heads, setup.kv_heads, setup.head_dim, setup.device
    k = torch.randn(batch, context, kv_heads, head_dim, device=device, dtype=setup.dtype)
    v = torch.randn_like(k)
    k_pages, v_pages, block_tables = paged_kv(k, v, setup.block_size)
    del k, v
    q = torch.randn(batch, heads, head_dim, device=device, dtype=setup.dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    def ours() -> torch.Tensor:
        return kernels.decode_attention(q, k_pages, v_pages, block_tables, seq_lens, scale, backend="triton")

    # The reference pads and gathers the whole batch; check the first sequence only to bound its memory.
    expected = kernels.decode_attention(
        q[:1], k_pages, v_pages, block_tables[:1], seq_lens[:1], scale, backend="torch"
    )
    error = (ours()[:1].float() - expected.float()).abs().max().item()
    eager_ms = setup.time_ms(ours)
    ms = setup.time_ms(_graph_of(ours) if device.type == "cuda" else ours)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_pages.element_size()
    return {"batch": batch, "context": context, "ms": ms, "eager_ms": eager_ms,
            "bandwidth_gb_s": kv_bytes / (ms * 1e-3) / 1e9, "max_abs_err_vs_reference": error}


def _graph_of(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`fn` captured in a CUDA graph, as the runner replays decode steps (engine/cuda_graphs.py): the replay
    times the kernels without the host's per-launch cost, which dominates small batches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay


def paged_kv(
    k: torch.Tensor, v: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [S, L, Hkv, D] -> pages [S * nb, B, Hkv, D] in shuffled page order and block_tables int32 [S, nb]."""
    num_seqs, seq_len, kv_heads, head_dim = k.shape
    num_blocks = math.ceil(seq_len / block_size)
    pad = num_blocks * block_size - seq_len
    page_order = torch.randperm(num_seqs * num_blocks, device=k.device)
    pages = []
    for x in (k, v):
        blocks = F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(num_seqs * num_blocks, block_size, kv_heads, head_dim)
        paged = torch.empty_like(blocks)
        paged[page_order] = blocks
        pages.append(paged)
    block_tables = page_order.reshape(num_seqs, num_blocks).to(torch.int32)
    return pages[0], pages[1], block_tables


def _time_ms(fn: Callable[[], torch.Tensor], rep_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def _print_tables(device: str, peak: float, prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> None:
    print(f"device: {device}  peak bandwidth {peak / 1e9:.0f} GB/s")
    print(f"\nprefill attention vs SDPA (target ratio >= {PREFILL_TARGET})")
    print(f"{'tiles':>12} {'tokens':>7} {'cached':>7} {'ours ms':>9} {'sdpa ms':>9} {'ratio':>6} {'TFLOP/s':>8} "
          f"{'max err':>8}")
    for row in prefill:
        print(f"{row['tiles']:>12} {row['tokens']:>7} {row['num_cached']:>7} {row['ours_ms']:>9.3f} "
              f"{row['sdpa_ms']:>9.3f} {row['ratio']:>6.2f} {row['ours_tflops']:>8.1f} "
              f"{row['max_abs_err_vs_sdpa']:>8.4f}")
    print(f"\ndecode attention bandwidth (target >= {DECODE_TARGET:.0%} of peak), replayed from a CUDA graph")
    print(f"{'batch':>6} {'context':>8} {'ms':>8} {'eager ms':>9} {'GB/s':>8} {'of peak':>8} {'max err':>8}")
    for row in decode:
        print(f"{row['batch']:>6} {row['context']:>8} {row['ms']:>8.3f} {row['eager_ms']:>9.3f} "
              f"{row['bandwidth_gb_s']:>8.0f} "
              f"{row['fraction_of_peak']:>8.1%} {row['max_abs_err_vs_reference']:>8.4f}")


def _fitting(bench: Callable[..., dict[str, Any]], setup: Setup, seq_len: int, fraction: float,
             tiles: triton_prefill.PrefillTiles | None) -> list[dict[str, Any]]:
    """[bench's row], or [] with a message when the tile shape needs more than the device has (a sweep goes on)."""
    try:
        return [bench(setup, seq_len, fraction, tiles)]
    except OutOfResources as exc:
        print(f"prefill tiles {_tiles_name(tiles)} do not fit this device, skipped: {exc}", file=sys.stderr)
        return []


def _tiles_name(tiles: triton_prefill.PrefillTiles | None) -> str:
    if tiles is None:
        return "default"
    return f"{tiles.block_m}x{tiles.block_n}x{tiles.num_warps}x{tiles.num_stages}"


def _tiles_list(text: str) -> list[triton_prefill.PrefillTiles]:
    tiles = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        fields = part.split("x")
        if len(fields) != 4 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise argparse.ArgumentTypeError(f"tile shape {part!r} is not BLOCK_MxBLOCK_NxWARPSxSTAGES, "
                                             f"e.g. 128x64x8x3")
        tiles.append(triton_prefill.PrefillTiles(*(int(f) for f in fields)))
    if not tiles:
        raise argparse.ArgumentTypeError("expected at least one tile shape, e.g. 128x64x8x3")
    return tiles


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
