"""The model runner on CUDA: the Triton backend against the torch backend, prefill with a reused prefix and
batched decode, over pages in the model's dtype and compressed (kv.cache_dtype int8, fp8_e4m3); and decode steps replayed from CUDA graphs (one per batch-size bucket) against eager steps."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.loader import LoadedModel, load_model

pytestmark = pytest.mark.gpu

BLOCK, NUM_PAGES, MAX_LEN = 16, 128, 512
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 6e-2}


def runner_for(loaded: LoadedModel, backend: str, cuda_graphs: bool = False, max_batch_size: int = 8,
               cache_dtype: str = "auto") -> ModelRunner:
    kv = KVPages.for_model(loaded.args, num_pages=NUM_PAGES, block_size=BLOCK, dtype=loaded.dtype, device="cuda",
                           cache_dtype=cache_dtype)
    return ModelRunner(loaded.model, kv, backend=backend, cuda_graphs=cuda_graphs, max_batch_size=max_batch_size,
                       max_seq_len=MAX_LEN)


def prompts(num: int) -> list[list[int]]:
    return [[3 + (11 * i + 7 * s) % 300 for i in range(20 + 9 * s)] for s in range(num)]


def prefill_all(runner: ModelRunner, tokens: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    pages_of = PageAllocator(NUM_PAGES)  # fresh for every prefill: each starts from the first pages
    pages = [pages_of.allocate(-(-(len(t) + 16) // BLOCK), f"s{i}") for i, t in enumerate(tokens)]
    batch = build_prefill_batch([PrefillSeq(t, 0, p) for t, p in zip(tokens, pages)], block_size=BLOCK,
                                num_pages=NUM_PAGES, device="cuda")
    return runner.prefill(batch), pages


def decode_step(runner: ModelRunner, last: list[int], lengths: list[int], pages: list[list[int]]) -> torch.Tensor:
    seqs = [DecodeSeq(t, n, p) for t, n, p in zip(last, lengths, pages)]
    return runner.decode(build_decode_batch(seqs, block_size=BLOCK, num_pages=NUM_PAGES, device="cuda"))


@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_triton_backend_matches_torch_backend(dtype: str, cache_dtype: str) -> None:
    loaded = load_model("random:small", dtype=dtype, device="cuda", seed=3)
    tol = TOLERANCE[loaded.dtype]
    tokens = prompts(3)
    results = []
    for backend in ("triton", "torch"):
        runner = runner_for(loaded, backend, cache_dtype=cache_dtype)
        first, pages = prefill_all(runner, tokens)
        suffix = PrefillSeq([5, 6, 7], len(tokens[0]), pages[0])  # a second chunk over the first as prefix
        chunk = runner.prefill(build_prefill_batch([suffix], block_size=BLOCK, num_pages=NUM_PAGES, device="cuda"))
        lengths = [len(t) for t in tokens]
        lengths[0] += 3
        step = decode_step(runner, [int(x) for x in first.argmax(-1)], lengths, pages)
        results.append((first, chunk, step))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_graph_decode_equals_eager_per_bucket(dtype: str) -> None:
    loaded = load_model("random:small", dtype=dtype, device="cuda", seed=4)
    tol = TOLERANCE[loaded.dtype]
    graphed, eager = runner_for(loaded, "triton", cuda_graphs=True), runner_for(loaded, "triton")
    assert graphed.graphs is not None and graphed.graphs.buckets == [1, 2, 4, 8]
    for num_seqs in (1, 3, 5, 8, 3):  # buckets 1, 4, 8, 8, 4: captured once each, replayed after
        tokens = prompts(num_seqs)
        (first_g, pages_g), (first_e, pages_e) = prefill_all(graphed, tokens), prefill_all(eager, tokens)
        last, lengths = [int(x) for x in first_e.argmax(-1)], [len(t) for t in tokens]
        for _ in range(3):
            out_g = decode_step(graphed, last, lengths, pages_g)
            out_e = decode_step(eager, last, lengths, pages_e)
            torch.testing.assert_close(out_g, out_e, atol=tol, rtol=tol)
            assert out_g.shape == (num_seqs, loaded.args.vocab_size)
            last, lengths = [int(x) for x in out_e.argmax(-1)], [n + 1 for n in lengths]
    assert sorted(graphed.graphs.graphs) == [1, 4, 8]


def test_cuda_graphs_fall_back_to_eager_past_the_largest_bucket() -> None:
    loaded = load_model("random:small", dtype="float16", device="cuda", seed=5)
    runner = runner_for(loaded, "triton", cuda_graphs=True, max_batch_size=2)
    first, pages = prefill_all(runner, prompts(3))
    out = decode_step(runner, [int(x) for x in first.argmax(-1)], [len(t) for t in prompts(3)], pages)
    assert out.shape[0] == 3 and runner.graphs is not None and not runner.graphs.graphs
