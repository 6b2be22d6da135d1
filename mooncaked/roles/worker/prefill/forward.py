"""The prefill forward shared by the prefill role and a decode instance's inline prefill (compute thread).

1. One prompt longer than `prefill_chunk` runs alone, chunk by chunk (the chunk boundary is explicit here: a
   prefill group's pipeline splits a prompt at it, roles/worker/group/forward.py); otherwise the prompts run as one
   batch.
2. Before layer i of the first chunk, the forward waits until each plan's cached prefix of layer i is in its
   pages (the loader started at planning time and runs ahead); after layer i of the last chunk, each plan
   queues layer i's new KV for its destinations (copied and sent off this thread) and the next layer starts.
   A cancelled plan, or one whose loading failed, sends nothing more; when no plan is left the forward stops
   at the next layer boundary. A failed plan's rows compute on stale pages and its reply is the failure.
3. The last chunk's logits give every prompt its first token; the masks of prompts with a grammar are computed on
   the mask thread while the forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from mooncaked.engine.batch import build_prefill_batch, split_prefill_chunks
from mooncaked.model.grammar import GrammarState
from mooncaked.roles.worker.kv.plan import KvPlan
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.roles.worker.messages import SamplingSpec, TokenSample
from mooncaked.roles.worker.sampling import generator_at, history_of, sample_rows, to_params
from mooncaked.roles.worker.worker import Worker


class ForwardPlan(Protocol):
    """What the layer callbacks use of a prompt's plan (kv.plan.KvPlan; a pipeline stage's group.stage_job.StageJob)."""

    kv: RequestKv
    is_cancelled: bool

    def store_layer(self, layer: int) -> None: ...


def run_prefill_forward(worker: Worker, plans: Sequence[KvPlan], specs: Sequence[SamplingSpec],
                        grammars: Sequence[GrammarState | None] | None = None) -> list[TokenSample]:
    """`grammars[i]`: prompt i's grammar state (its output so far consumed), advanced by the first token."""
    runner, kv_pages = worker.runner, worker.kv_pages
    assert runner is not None and kv_pages is not None and worker.grammar is not None
    masks = worker.grammar.masks(grammars) if grammars is not None else None  # under way during the forward
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
            before_layer=lambda i: before_layer(worker, plans, i, is_first),
            after_layer=lambda i: after_layer(worker, plans, i, is_last))
    assert logits is not None
    params = [to_params(spec, worker.vocab_size) for spec in specs]
    return sample_rows(worker, logits, params, [generator_at(p, s.num_sampled) for p, s in zip(params, specs)],
                       [history_of(plan.token_ids, p, s.num_sampled) for plan, p, s in zip(plans, params, specs)],
                       grammars, masks)


class PrefillCancelled(Exception):
    """Every prompt of the forward was cancelled: it stops at the next layer boundary."""


def _check_cancelled(plans: Sequence[ForwardPlan]) -> None:
    if all(plan.is_cancelled or plan.kv.is_failed for plan in plans):
        failed = next((plan for plan in plans if plan.kv.is_failed and not plan.is_cancelled), None)
        if failed is not None:
            failed.kv.raise_failure()
        raise PrefillCancelled("every request of this prefill batch was cancelled")


def before_layer(worker: Worker, plans: Sequence[ForwardPlan], layer: int, is_first: bool) -> None:
    """Before layer `layer` of a chunk: the first chunk waits for that layer's prefix KV; later ones only check
    whether every plan was cancelled (PrefillCancelled)."""
    if is_first:
        _load_layer(plans, layer)
    else:
        _check_cancelled(plans)
    if worker.timeline is not None:
        worker.timeline.record("compute", "", layer, "start")


def after_layer(worker: Worker, plans: Sequence[ForwardPlan], layer: int, is_last: bool) -> None:
    """After layer `layer` of a chunk: the last chunk queues that layer's new KV for every destination."""
    if worker.timeline is not None:
        worker.timeline.record("compute", "", layer, "end")
    if is_last:
        _store_layer(plans, layer)


def _load_layer(plans: Sequence[ForwardPlan], layer: int) -> None:
    """Wait until layer `layer` of every plan's prefix is in its pages (a failed plan drops out)."""
    for plan in plans:
        if not plan.is_cancelled:
            plan.kv.wait_layer_loaded(layer)
    _check_cancelled(plans)


def _store_layer(plans: Sequence[ForwardPlan], layer: int) -> None:
    _check_cancelled(plans)
    for plan in plans:
        plan.store_layer(layer)
