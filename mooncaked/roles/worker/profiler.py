"""A worker's self-profile before it reports ready: the samples its performance model starts from.

1. `profile_worker(worker, budget_s, with_decode)` runs on the compute thread over the worker's own KV pages
   before any request holds one (their contents are scratch): one warm-up forward first.
2. Prefill: prompts of 64, 256, 1024, ... tokens up to one chunk (`prefill_chunk`) without a cached prefix,
   then with one (a half, three quarters or a quarter of the prompt, in turn), then shorter ones; after the
   first three, a point is skipped when its expected time does not fit the budget left.
3. Decode (decode instances, which also prefill short prompts inline): steps at batch sizes 1, 4, 16, ...
   (at most `max_batch_size`) over short and long contexts, each the median of a few steps including
   sampling, as the decode loop times them.
4. A prefill group's stage profiles its own layers on chunks of up to `cpp_chunk_tokens` (a later stage from
   stand-in hidden states): its model is one stage of the group's pipeline prediction (sched/pipeline.py).
5. The samples go into `worker.perf`, which is refitted; the profile's time and sample counts are logged.
   `worker.profile_s: 0` skips it: the model then starts empty and learns from live samples alone.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.model.heap import release_free_heap
from mooncaked.model.sampling_params import SamplingParams
from mooncaked.roles.worker.sampling import sample_rows
from mooncaked.roles.worker.worker import Worker

logger = logging.getLogger(__name__)

PREFIX_FRACTIONS = (0.5, 0.75, 0.25)
MIN_PREFILL_SAMPLES = 3  # the prefill model's coefficients
SHORT_S = 0.05  # a forward this short is timed three times
DECODE_CONTEXTS = (64, 1024)
DECODE_REPEATS = 2
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class ProfileResult:
    seconds: float
    num_prefill_samples: int
    num_decode_samples: int


async def profile(worker: Worker, *, with_decode: bool) -> None:
    """Run the profile on the compute thread (after `worker.start()`, before the role serves)."""
    budget_s = worker.section.profile_s
    if budget_s <= 0:
        return
    result = await worker.compute(profile_worker, worker, budget_s, with_decode)
    coefficients = worker.perf.coefficients()
    logger.info("%s profiled itself in %.1f s: %d prefill and %d decode samples; prefill model %s, decode model %s",
                worker.instance.name, result.seconds, result.num_prefill_samples, result.num_decode_samples,
                _format(coefficients.prefill), _format(coefficients.decode))


def _format(coefficients: tuple[float, ...]) -> str:
    return "(" + ", ".join(f"{c:.3g}" for c in coefficients) + ")" if coefficients else "unfitted"


def profile_worker(worker: Worker, budget_s: float, with_decode: bool) -> ProfileResult:
    """Compute thread. Spends at most about `budget_s` (a point is started only if it is expected to fit)."""
    started = time.monotonic()
    deadline = started + budget_s
    for num_prefix in (0, 8):  # warm-up: first-call allocations and kernel choices, with and without a prefix
        _time_prefill(worker, 16, num_prefix)
    prefill_deadline = started + budget_s * (0.5 if with_decode else 1.0)
    num_prefill = _profile_prefill(worker, prefill_deadline)
    num_decode = _profile_decode(worker, deadline) if with_decode else 0
    worker.perf.refit()
    release_free_heap()  # prompt-sized activations: a worker's resident memory should show what it holds
    return ProfileResult(time.monotonic() - started, num_prefill, num_decode)


def _max_prompt_tokens(worker: Worker) -> int:
    """One chunk: `prefill_chunk`, or on a prefill group's stage `cpp_chunk_tokens` (its unit of work)."""
    assert worker.kv_pages is not None
    section = worker.section
    chunk = section.cpp_chunk_tokens if worker.stage is not None else section.prefill_chunk
    return min(chunk, worker.config.model.max_model_len, worker.kv_pages.num_pages * worker.block_size)


def prefill_points(max_tokens: int) -> list[tuple[int, float]]:
    """(prompt tokens, prefix fraction) to profile: lengths 64, 256, 1024, ... and the longest one chunk allows
    without a prefix (they determine the fit), then each with a prefix, then halves and quarters of them."""
    lengths = [n for n in (64 * 4**i for i in range(8)) if n < max_tokens] + [max_tokens]
    points = [(n, 0.0) for n in lengths]
    points += [(n, PREFIX_FRACTIONS[i % len(PREFIX_FRACTIONS)]) for i, n in enumerate(lengths)]
    points += [(max(n // 2, 2), PREFIX_FRACTIONS[(i + 1) % len(PREFIX_FRACTIONS)]) for i, n in enumerate(lengths)]
    return points + [(max(n // 4, 2), 0.0) for n in lengths]


def _profile_prefill(worker: Worker, deadline: float) -> int:
    """Every point of `prefill_points` whose expected time fits what is left (at least MIN_PREFILL_SAMPLES)."""
    num_samples = 0
    seconds_per_token = 0.0
    for num_tokens, fraction in prefill_points(_max_prompt_tokens(worker)):
        new_tokens = num_tokens - int(num_tokens * fraction)
        expected_s = seconds_per_token * new_tokens * (1 + num_tokens / 2048)
        if num_samples >= MIN_PREFILL_SAMPLES and time.monotonic() + expected_s > deadline:
            continue
        seconds = _sample_prefill(worker, num_tokens, fraction)
        seconds_per_token = max(seconds_per_token, seconds / max(new_tokens, 1))
        num_samples += 1
    return num_samples


def _sample_prefill(worker: Worker, num_tokens: int, prefix_fraction: float) -> float:
    """One profile sample: a single forward, or the median of three when one is short (timer noise)."""
    num_prefix = int(num_tokens * prefix_fraction)
    seconds = _time_prefill(worker, num_tokens, num_prefix)
    if seconds < SHORT_S:
        seconds = statistics.median([seconds, *(_time_prefill(worker, num_tokens, num_prefix) for _ in range(2))])
    worker.perf.add_profile_prefill(num_tokens, num_prefix, seconds)
    return seconds


def _time_prefill(worker: Worker, num_tokens: int, num_prefix_tokens: int) -> float:
    """One prefill forward of `num_tokens - num_prefix_tokens` new tokens after a prefix already in pages."""
    runner, kv_pages, loaded = worker.runner, worker.kv_pages, worker.loaded
    assert runner is not None and kv_pages is not None and loaded is not None
    num_pages = -(-num_tokens // worker.block_size)
    token_ids = [(7 * i + 3) % loaded.args.vocab_size for i in range(num_tokens - num_prefix_tokens)]
    seq = PrefillSeq(token_ids, num_prefix_tokens, list(range(num_pages)))
    hidden_in = _stage_input(worker, len(token_ids))
    is_last_stage = worker.stage is None or worker.stage.is_last
    started = time.monotonic()
    batch = build_prefill_batch([seq], block_size=worker.block_size, num_pages=kv_pages.num_pages,
                                device=kv_pages.device)
    out = runner.prefill(batch, hidden_in=hidden_in, return_hidden=not is_last_stage)
    if is_last_stage:
        sample_rows(worker, out, [GREEDY], [None])
    return time.monotonic() - started


def _stage_input(worker: Worker, num_tokens: int) -> torch.Tensor | None:
    """A later stage of a prefill group starts from hidden states [T, hidden]: seeded ones stand in for them."""
    if worker.stage is None or worker.stage.is_first:
        return None
    assert worker.loaded is not None
    generator = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, worker.loaded.args.hidden_size, generator=generator)
    return hidden.to(worker.loaded.device, worker.loaded.dtype)


def _profile_decode(worker: Worker, deadline: float) -> int:
    """Batch sizes 1, 4, 16, ... (up to max_batch_size) over short and long contexts, while they fit."""
    assert worker.kv_pages is not None
    num_samples = 0
    last_s = 0.0
    assert worker.loaded is not None
    max_positions = min(worker.config.model.max_model_len, worker.loaded.args.context_length)
    batch_sizes = [b for b in (4**i for i in range(6)) if b < worker.section.max_batch_size]
    for batch_size in [*batch_sizes, worker.section.max_batch_size]:
        for context in DECODE_CONTEXTS:
            pages_per_seq = -(-(context + 1) // worker.block_size)
            if batch_size * pages_per_seq > worker.kv_pages.num_pages or context >= max_positions:
                continue
            if num_samples >= 3 and time.monotonic() + (DECODE_REPEATS + 1) * 2 * last_s > deadline:
                return num_samples
            seconds = _time_decode(worker, batch_size, context, pages_per_seq)
            worker.perf.add_profile_decode(batch_size, batch_size * (context + 1), seconds)
            num_samples += 1
            last_s = max(last_s, seconds)
    return num_samples


def _time_decode(worker: Worker, batch_size: int, context: int, pages_per_seq: int) -> float:
    """The median of DECODE_REPEATS steps (after one warm-up) over `batch_size` sequences of `context` tokens."""
    runner, kv_pages, loaded = worker.runner, worker.kv_pages, worker.loaded
    assert runner is not None and kv_pages is not None and loaded is not None
    seqs = [DecodeSeq(token_id=(11 * i + 5) % loaded.args.vocab_size, num_cached_tokens=context,
                      page_ids=list(range(i * pages_per_seq, (i + 1) * pages_per_seq))) for i in range(batch_size)]
    times = []
    for _ in range(DECODE_REPEATS + 1):
        started = time.monotonic()
        batch = build_decode_batch(seqs, block_size=worker.block_size, num_pages=kv_pages.num_pages,
                                   device=kv_pages.device)
        logits = runner.decode(batch)
        sample_rows(worker, logits, [GREEDY] * batch_size, [None] * batch_size)
        times.append(time.monotonic() - started)
    return statistics.median(times[1:])
