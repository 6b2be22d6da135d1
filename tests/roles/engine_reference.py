"""Greedy generation in one process with the engine alone: the reference the disaggregated path must equal."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.loader import LoadedModel


Adjust = Callable[[list[float], list[int]], list[float]]  # (logits row, output so far) -> adjusted row


def greedy_tokens(loaded: LoadedModel, prompt: list[int], num_tokens: int, block_size: int = 16,
                  adjust: Adjust | None = None) -> list[int]:
    """`adjust` applies sampling controls to each row before its argmax (tests/model/sampling_reference.py)."""
    total = len(prompt) + num_tokens
    num_pages = -(-total // block_size)
    kv_pages = KVPages.for_model(loaded.args, num_pages=num_pages, block_size=block_size, dtype=loaded.dtype,
                                 device=loaded.device)
    runner = ModelRunner(loaded.model, kv_pages, backend="torch")
    page_ids = list(range(num_pages))
    batch = build_prefill_batch([PrefillSeq(prompt, 0, page_ids)], block_size=block_size, num_pages=num_pages,
                                device="cpu")
    tokens: list[int] = []

    def choose(row: torch.Tensor) -> int:
        if adjust is None:
            return int(torch.argmax(row))
        scores = adjust(row.tolist(), tokens)
        return scores.index(max(scores))

    tokens.append(choose(runner.prefill(batch)[0]))
    while len(tokens) < num_tokens:
        seq = DecodeSeq(tokens[-1], len(prompt) + len(tokens) - 1, page_ids)
        logits = runner.decode(build_decode_batch([seq], block_size=block_size, num_pages=num_pages, device="cpu"))
        tokens.append(choose(logits[0]))
    return tokens
