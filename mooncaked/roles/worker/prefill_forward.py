"""The prefill forward shared by the prefill role and a decode instance's inline prefill (compute thread).

1. One prompt longer than `prefill_chunk` runs alone, chunk by chunk (the chunk boundary is explicit here so
   a pipeline of prefill instances can later split a prompt at it); otherwise the prompts run as one batch.
2. Before layer i of the first chunk, each plan's cached prefix of layer i is loaded into pages; after layer i
   of the last chunk, each plan stages layer i's new KV and sends it to its destinations. A cancelled plan
   sends nothing more; when every plan is cancelled the forward stops at the next layer boundary.
3. The last chunk's logits give every prompt its first token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncaked.engine.batch import build_prefill_batch, split_prefill_chunks
from mooncaked.roles.worker.kv_plan import KvPlan
from mooncaked.roles.worker.messages import SamplingSpec, TokenSample
from mooncaked.roles.worker.sampling import generator_at, sample_rows, to_params
from mooncaked.roles.worker.worker import Worker


def run_prefill_forward(worker: Worker, plans: Sequence[KvPlan], specs: Sequence[SamplingSpec]) -> list[TokenSample]:
    runner, kv_pages = worker.runner, worker.kv_pages
    assert runner is not None and kv_pages is not None
    seqs = [plan.prefill_seq() for plan in plans]
    chunks = split_prefill_chunks(seqs[0], worker.section.prefill_chunk) if len(plans) == 1 else [seqs[0]]
    logits: torch.Tensor | None = None
    for index, chunk in enumerate(chunks):
        chunk_seqs = [chunk] if len(plans) == 1 else seqs
        batch = build_prefill_batch(chunk_seqs, block_size=worker.block_size, num_pages=kv_pages.num_pages,
                                    device=kv_pages.device)
        is_first, is_last = index == 0, index == len(chunks) - 1
        logits = runner.prefill(
            batch,
            before_layer=(lambda i: _load_layer(plans, i)) if is_first else None,
            after_layer=(lambda i: _store_layer(plans, i)) if is_last else None)
    assert logits is not None
    params = [to_params(spec) for spec in specs]
    return sample_rows(worker, logits, params, [generator_at(p, s.num_sampled) for p, s in zip(params, specs)])


class PrefillCancelled(Exception):
    """Every prompt of the forward was cancelled: it stops at the next layer boundary."""


def _check_cancelled(plans: Sequence[KvPlan]) -> None:
    if all(plan.is_cancelled for plan in plans):
        raise PrefillCancelled("every request of this prefill batch was cancelled")


def _load_layer(plans: Sequence[KvPlan], layer: int) -> None:
    _check_cancelled(plans)
    for plan in plans:
        plan.kv.load_layer(layer)


def _store_layer(plans: Sequence[KvPlan], layer: int) -> None:
    _check_cancelled(plans)
    for plan in plans:
        plan.store_layer(layer)
