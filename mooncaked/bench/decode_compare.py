"""Greedy decode, ours vs transformers, on the same chat prompts: what `bench model` and `bench model --model moe`
measure.

1. `OursGenerator(loaded, num_pages, block_size)` generates greedily through ModelRunner on pages of its own;
   `hf_generate(hf, prompts, new_tokens, pad_id)` through transformers' `generate` (left-padded). EOS is
   suppressed on both sides (transformers: min_new_tokens = max_new_tokens), so both produce exactly
   `new_tokens` tokens per sequence.
2. `measure_decode(...)` warms both up, then runs them alternately (`Timing`: best wall and CPU seconds) and
   reports tok/s, their ratio and the share of equal tokens at one batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.loader import LoadedModel

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash function is in two sentences.",
    "List three uses of a paperclip.",
    "How do plants make food from sunlight?",
    "Give me a tip for learning a new language.",
    "Why is the sky blue? Answer briefly, please, for a ten year old child.",
    "Summarize the plot of a heist movie in one paragraph.",
]


class OursGenerator:
    """Greedy generation through ModelRunner; owns its KV pages and their allocator."""

    def __init__(self, loaded: LoadedModel, num_pages: int, block_size: int) -> None:
        self.kv = KVPages.for_model(loaded.args, num_pages=num_pages, block_size=block_size,
                                    dtype=loaded.dtype, device="cpu")
        self.pages = PageAllocator(num_pages)
        self.runner = ModelRunner(loaded.model, self.kv)
        self.suppressed = torch.tensor(loaded.eos_token_ids, dtype=torch.int64)

    def generate(self, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
        alloc, block = self.pages, self.kv.block_size
        pages = [alloc.allocate(self.kv.num_pages_for(len(p) + new_tokens), f"bench-{i}")
                 for i, p in enumerate(prompts)]
        try:
            batch = build_prefill_batch([PrefillSeq(p, 0, pg) for p, pg in zip(prompts, pages)],
                                        block_size=block, num_pages=self.kv.num_pages, device="cpu")
            outputs = [[t] for t in self._greedy(self.runner.prefill(batch))]
            for _ in range(new_tokens - 1):
                seqs = [DecodeSeq(out[-1], len(p) + len(out) - 1, pg) for p, out, pg in zip(prompts, outputs, pages)]
                logits = self.runner.decode(build_decode_batch(seqs, block_size=block, num_pages=self.kv.num_pages,
                                                               device="cpu"))
                for out, token in zip(outputs, self._greedy(logits)):
                    out.append(token)
            return outputs
        finally:
            for i in range(len(prompts)):
                alloc.free_owner(f"bench-{i}")

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        logits = logits.index_fill(1, self.suppressed, float("-inf"))  # as transformers' min_new_tokens does
        tokens: list[int] = logits.argmax(dim=-1).tolist()
        return tokens


def hf_generate(hf: Any, prompts: Sequence[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    generated: list[list[int]] = out[:, width:].tolist()
    return generated


@dataclass
class Timing:
    """Best wall and best process CPU seconds over the runs of one side."""

    wall_s: float = float("inf")
    cpu_s: float = float("inf")

    def add(self, fn: Callable[[], object]) -> float:
        """Run fn once; returns its wall seconds."""
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        wall_s, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
        self.wall_s, self.cpu_s = min(self.wall_s, wall_s), min(self.cpu_s, cpu_s)
        return wall_s


def _alternating(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[Timing, Timing]:
    """Best times of a and b, measured a, b, a, b, ... so machine noise hits both alike. CPU time is reported
    too: on a shared, oversubscribed host it is far steadier than wall time."""
    timing_a, timing_b = Timing(), Timing()
    for _ in range(repeats):
        timing_a.add(a)
        timing_b.add(b)
    return timing_a, timing_b


def chat_prompts(loaded: LoadedModel, count: int) -> list[list[int]]:
    texts = [loaded.chat_template.render([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
             for i in range(count)]
    return [loaded.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def measure_decode(loaded: LoadedModel, ours: OursGenerator, hf: Any, batch_size: int, new_tokens: int,
                   repeats: int) -> dict[str, Any]:
    prompts = chat_prompts(loaded, batch_size)
    pad_id = loaded.eos_token_ids[0] if loaded.eos_token_ids else 0
    ours_tokens = ours.generate(prompts, new_tokens)  # warm-up, and the tokens to compare
    hf_tokens = hf_generate(hf, prompts, new_tokens, pad_id)
    assert all(len(t) == new_tokens for t in ours_tokens + hf_tokens)
    ours_t, hf_t = _alternating(lambda: ours.generate(prompts, new_tokens),
                                lambda: hf_generate(hf, prompts, new_tokens, pad_id), repeats)
    num_tokens = batch_size * new_tokens
    same = sum(a == b for x, y in zip(ours_tokens, hf_tokens) for a, b in zip(x, y))
    b = batch_size
    return {f"ours_tok_s_b{b}": num_tokens / ours_t.wall_s, f"hf_tok_s_b{b}": num_tokens / hf_t.wall_s,
            f"ratio_b{b}": hf_t.wall_s / ours_t.wall_s, f"cpu_ratio_b{b}": hf_t.cpu_s / ours_t.cpu_s,
            f"tokens_match_b{b}": same / num_tokens}
