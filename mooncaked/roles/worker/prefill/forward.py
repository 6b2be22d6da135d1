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
   the mask thread while the forward runs. A prompt asking for prompt logprobs has every row's logits kept and
   read (prompt_logprobs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mooncaked.engine.batch import build_prefill_batch, split_prefill_chunks
from mooncaked.model.grammar import GrammarState
from mooncaked.roles.worker.kv.plan import KvPlan
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.roles.worker.messages import SamplingSpec, TokenSample
from mooncaked.roles.worker.prefill.prompt_logprobs import collect, wants_prompt_logprobs
from mooncaked.roles.worker.sampling import generator_at, history_of, sample_rows, sequence_params, to_params
from mooncaked.roles.worker.worker import Worker


class ForwardPlan(Protocol):
    """What the layer callbacks use of a prompt's plan (kv.plan.KvPlan; a pipeline stage's group.stage_job.StageJob)."""

    kv: RequestKv
    is_cancelled: bool

    def store_layer(self, layer: int) -> None: ...


@dataclass(frozen=True)
class ForwardResult:
    first_tokens: list[TokenSample]  # one per prompt (its sequence 0's)
    prompt_logprobs: list[list[TokenSample]]  # per prompt: its tokens from the second on, when its spec asks
    more_first_tokens: list[list[TokenSample]]  # per prompt: its sequences 1.. (parallel sampling)


def run_prefill_forward(worker: Worker, plans: Sequence[KvPlan], specs: Sequence[SamplingSpec],
                        grammars: Sequence[Sequence[GrammarState | None]] | None = None) -> ForwardResult:
    """`grammars[i][q]`: prompt i's sequence q's grammar state (its output so far consumed), advanced by its first
    token; a prompt of `num_sequences` sequences draws that many first tokens from its logits row."""
    runner, kv_pages = worker.runner, worker.kv_pages
    assert runner is not None and kv_pages is not None and worker.grammar is not None
    rows = [i for i, spec in enumerate(specs) for _ in range(spec.num_sequences)]
    flat_grammars = [state for per_prompt in grammars for state in per_prompt] if grammars is not None else None
    masks = worker.grammar.masks(flat_grammars) if flat_grammars is not None else None  # during the forward
    seqs = [plan.prefill_seq() for plan in plans]
    chunks = split_prefill_chunks(seqs[0], worker.section.prefill_chunk) if len(plans) == 1 else [seqs[0]]
    is_every_row = wants_prompt_logprobs(specs)
    prompt_logprobs: list[list[TokenSample]] = [[] for _ in plans]
    logits: torch.Tensor | None = None
    for index, chunk in enumerate(chunks):
        chunk_seqs = [chunk] if len(plans) == 1 else seqs
        batch = build_prefill_batch(chunk_seqs, block_size=worker.block_size, num_pages=kv_pages.num_pages,
                                    device=kv_pages.device)
        is_first, is_last = index == 0, index == len(chunks) - 1
        logits = runner.prefill(
            batch, return_all_logits=is_every_row,
            before_layer=lambda i: before_layer(worker, plans, i, is_first),
            after_layer=lambda i: after_layer(worker, plans, i, is_last))
        if is_every_row:
            collect(logits, batch.cu_seqlens_q.tolist(), chunk_seqs, [plan.token_ids for plan in plans], specs,
                    prompt_logprobs)
            logits = logits.index_select(0, batch.last_token_indices)
    assert logits is not None
    params = [sequence_params(to_params(specs[i], worker.vocab_size), q) for i, q in _sequences(specs)]
    samples = sample_rows(worker, logits if len(rows) == len(plans) else logits[rows], params,
                          [generator_at(p, specs[i].num_sampled) for p, i in zip(params, rows)],
                          [history_of(plans[i].token_ids, p, specs[i].num_sampled) for p, i in zip(params, rows)],
                          flat_grammars, masks)
    starts = [rows.index(i) for i in range(len(plans))]
    return ForwardResult([samples[s] for s in starts], prompt_logprobs,
                         [samples[s + 1: s + spec.num_sequences] for s, spec in zip(starts, specs)])


def _sequences(specs: Sequence[SamplingSpec]) -> list[tuple[int, int]]:
    """(prompt, sequence) of every row the first tokens are drawn from."""
    return [(i, q) for i, spec in enumerate(specs) for q in range(spec.num_sequences)]


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
