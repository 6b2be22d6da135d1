"""Layer-wise runner: prefix reuse, chunking, ragged batches, layer callbacks and aborts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from mooncaked.engine.batch import (DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch,
                                    split_prefill_chunks)
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.loader import LoadedModel, load_model
from mooncaked.model.presets import random_preset
from mooncaked.model.weight_names import random_hf_state_dict

BLOCK = 8
NUM_PAGES = 32


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("random:tiny", seed=5)


def _runner(tiny: LoadedModel) -> ModelRunner:
    kv = KVPages.for_model(tiny.args, num_pages=NUM_PAGES, block_size=BLOCK, dtype=torch.float32, device="cpu")
    return ModelRunner(tiny.model, kv, backend="torch")


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [3 + (7 * i + offset) % 250 for i in range(length)]


def _prefill(runner: ModelRunner, seqs: list[PrefillSeq], **kwargs: Any) -> torch.Tensor:
    batch = build_prefill_batch(seqs, block_size=BLOCK, num_pages=NUM_PAGES, device="cpu")
    return runner.prefill(batch, **kwargs)


def _greedy(runner: ModelRunner, first_logits: torch.Tensor, num_cached: int, pages: list[int],
            steps: int) -> list[int]:
    tokens = [int(first_logits.argmax())]
    for _ in range(steps):
        batch = build_decode_batch([DecodeSeq(tokens[-1], num_cached, pages)], block_size=BLOCK,
                                   num_pages=NUM_PAGES, device="cpu")
        tokens.append(int(runner.decode(batch)[0].argmax()))
        num_cached += 1
    return tokens


def test_incremental_prefill_over_cached_prefix_equals_full_prefill(tiny: LoadedModel) -> None:
    prompt = _prompt(37)
    full_runner, reuse_runner = _runner(tiny), _runner(tiny)
    full_pages = PageAllocator(NUM_PAGES).allocate(6, "full")
    full = _prefill(full_runner, [PrefillSeq(prompt, 0, full_pages)], return_all_logits=True)
    pages = PageAllocator(NUM_PAGES).allocate(6, "reuse")
    k = 2  # prefix blocks computed first, then reused from the pages
    _prefill(reuse_runner, [PrefillSeq(prompt[: k * BLOCK], 0, pages)])
    rest = _prefill(reuse_runner, [PrefillSeq(prompt[k * BLOCK:], k * BLOCK, pages)], return_all_logits=True)
    torch.testing.assert_close(rest, full[k * BLOCK:], atol=1e-4, rtol=0)
    assert _greedy(reuse_runner, rest[-1], len(prompt), pages, 6) == _greedy(full_runner, full[-1], len(prompt),
                                                                             full_pages, 6)


def test_chunked_prefill_equals_one_shot(tiny: LoadedModel) -> None:
    runner = _runner(tiny)
    prompt = _prompt(29, offset=1)
    pages = PageAllocator(NUM_PAGES).allocate(4, "r")
    full = _prefill(runner, [PrefillSeq(prompt, 0, pages)])
    logits = None
    for chunk in split_prefill_chunks(PrefillSeq(prompt, 0, pages), max_chunk_tokens=10):
        logits = _prefill(runner, [chunk])
    assert logits is not None
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)


def test_ragged_batch_equals_one_at_a_time(tiny: LoadedModel) -> None:
    runner = _runner(tiny)
    alloc = PageAllocator(NUM_PAGES)
    specs = [(_prompt(13, 2), 0), (_prompt(21, 3), 8), (_prompt(5, 4), 0)]  # (tokens, cached prefix length)
    pages = [alloc.allocate(runner.kv_pages.num_pages_for(len(t) + 2), f"s{i}") for i, (t, _) in enumerate(specs)]
    for (tokens, cached), p in zip(specs, pages):
        if cached:
            _prefill(runner, [PrefillSeq(tokens[:cached], 0, p)])
    seqs = [PrefillSeq(t[c:], c, p) for (t, c), p in zip(specs, pages)]
    together = _prefill(runner, seqs)
    alone = torch.cat([_prefill(runner, [s]) for s in seqs])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    decode = [DecodeSeq(int(together[i].argmax()), len(specs[i][0]), pages[i]) for i in range(3)]
    batch_logits = runner.decode(build_decode_batch(decode, block_size=BLOCK, num_pages=NUM_PAGES, device="cpu"))
    for i, seq in enumerate(decode):
        single = runner.decode(build_decode_batch([seq], block_size=BLOCK, num_pages=NUM_PAGES, device="cpu"))
        torch.testing.assert_close(batch_logits[i: i + 1], single, atol=1e-5, rtol=0)


def test_layer_callbacks_run_in_order_around_each_layer(tiny: LoadedModel) -> None:
    runner = _runner(tiny)
    pages = PageAllocator(NUM_PAGES).allocate(2, "r")
    events: list[tuple[str, int, bool]] = []

    def written(layer: int) -> bool:  # has this layer's KV for the new tokens reached the pages?
        return bool(runner.kv_pages.k_pages[layer][pages[0], 0].abs().sum() > 0)

    _prefill(runner, [PrefillSeq(_prompt(9), 0, pages)],
             before_layer=lambda i: events.append(("before", i, written(i))),
             after_layer=lambda i: events.append(("after", i, written(i))))
    num_layers = tiny.args.num_layers
    assert events == [e for i in range(num_layers) for e in (("before", i, False), ("after", i, True))]


def test_raising_callback_aborts_cleanly(tiny: LoadedModel) -> None:
    runner = _runner(tiny)
    alloc = PageAllocator(NUM_PAGES)
    pages = alloc.allocate(2, "r")
    seq = PrefillSeq(_prompt(12), 0, pages)
    calls: list[int] = []

    def fail_at_layer_one(i: int) -> None:
        calls.append(i)
        if i == 1:
            raise TimeoutError("prefix KV for layer 1 did not arrive")

    with pytest.raises(TimeoutError, match="layer 1"):
        _prefill(runner, [seq], before_layer=fail_at_layer_one)
    assert calls == [0, 1]
    assert alloc.num_free == NUM_PAGES - 2 and alloc.pages_of("r") == pages
    retry = _prefill(runner, [seq])  # the same pages are simply recomputed
    fresh = _runner(tiny)
    torch.testing.assert_close(retry, _prefill(fresh, [seq]), atol=0, rtol=0)


def test_runner_rejects_mismatched_pages(tiny: LoadedModel) -> None:
    kv = KVPages(num_layers=1, num_pages=2, block_size=BLOCK, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                 device="cpu")
    with pytest.raises(ValueError, match="do not match the model"):
        ModelRunner(tiny.model, kv)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        ModelRunner(tiny.model, _runner(tiny).kv_pages, backend="cuda-magic")


def _windowed_runner() -> ModelRunner:
    """Qwen2-style: layer 0 full attention, layer 1 a 6-token window (shorter than a page)."""
    args = random_preset("tiny", family="qwen2", qkv_bias=True, sliding_window=6, full_attention_layers=(0,))
    model = LlamaForCausalLM(args)
    model.load_hf_state_dict(random_hf_state_dict(args, seed=9))
    kv = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=BLOCK, dtype=torch.float32, device="cpu")
    return ModelRunner(model, kv, backend="torch")


def test_windowed_layers_chunked_prefill_and_ragged_decode() -> None:
    runner = _windowed_runner()
    assert runner.layer_windows == [None, 6]
    prompts = [_prompt(29, 5), _prompt(11, 6)]
    alloc = PageAllocator(NUM_PAGES)
    pages = [alloc.allocate(5, f"s{i}") for i in range(2)]
    full = _prefill(runner, [PrefillSeq(prompts[0], 0, pages[0])], return_all_logits=True)
    chunked = [_prefill(runner, [chunk], return_all_logits=True)
               for chunk in split_prefill_chunks(PrefillSeq(prompts[0], 0, pages[0]), max_chunk_tokens=7)]
    torch.testing.assert_close(torch.cat(chunked), full, atol=1e-5, rtol=0)
    _prefill(runner, [PrefillSeq(prompts[1], 0, pages[1])])
    seqs = [DecodeSeq(9, len(p), pg) for p, pg in zip(prompts, pages)]
    together = runner.decode(build_decode_batch(seqs, block_size=BLOCK, num_pages=NUM_PAGES, device="cpu"))
    for i, seq in enumerate(seqs):
        alone = runner.decode(build_decode_batch([seq], block_size=BLOCK, num_pages=NUM_PAGES, device="cpu"))
        torch.testing.assert_close(together[i: i + 1], alone, atol=1e-5, rtol=0)


def test_a_window_longer_than_the_sequence_changes_nothing() -> None:
    runner = _windowed_runner()
    args = runner.model.args
    unwindowed = LlamaForCausalLM(replace(args, sliding_window=None, full_attention_layers=()))
    unwindowed.load_hf_state_dict(random_hf_state_dict(args, seed=9))
    plain = ModelRunner(unwindowed, KVPages.for_model(args, num_pages=NUM_PAGES, block_size=BLOCK,
                                                      dtype=torch.float32, device="cpu"), backend="torch")
    for length, is_equal in ((6, True), (7, False)):
        seq = PrefillSeq(_prompt(length), 0, [0])
        same = torch.allclose(_prefill(runner, [seq]), _prefill(plain, [seq]), atol=1e-6, rtol=0)
        assert same == is_equal, length


@pytest.mark.parametrize("is_latent", [False, True])
def test_attention_in_the_rotated_space_equals_attention_itself(is_latent: bool) -> None:
    """What the runner does over packed pages: q, k, v rotated before attention, the output rotated back, equals
    attention of the unrotated vectors (an MLA latent passed as both k and v stays one tensor)."""
    from mooncaked.engine.runner import _in_rotated_space
    from mooncaked.kernels.quantized_kv import rotation

    head_dim = 576 if is_latent else 64
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(5, 4, head_dim, generator=generator)
    k = torch.randn(5, 1 if is_latent else 2, head_dim, generator=generator)
    v = k if is_latent else torch.randn(5, 2, head_dim, generator=generator)
    seen: list[bool] = []

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append(v is k)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)

    exact = attend(0, q, k, v)
    rotated = _in_rotated_space(attend, rotation(head_dim))(0, q, k, v)
    assert torch.allclose(rotated, exact, atol=1e-5)
    assert seen == [is_latent, is_latent]
    assert _in_rotated_space(attend, None) is attend
