"""The prefill time of a prefill group: a prompt's chunks flowing through a pipeline of stages (the paper's CPP).

1. Each stage holds a contiguous range of layers and has its own fitted prefill model over them, in the form of
   the single-instance model (sched/perf_model.py). Chunk j of the new tokens, tokens [b_j, e_j), costs stage s
   `stage_s.predict(e_j, b_j)`: a chunk is a prefill of its tokens after a prefix of everything before it.
2. Stage s starts chunk j once it has finished chunk j-1 and stage s-1's hidden states of chunk j have arrived
   (handing them over takes `handoff_s[s-1]`):
       finish[s][j] = max(finish[s][j-1], finish[s-1][j] + handoff_s[s-1]) + cost[s][j]
   The last stage's finish of the last chunk is the prefill time: the fill (chunk 0 crossing every stage), the
   steady state (each chunk paced by the slowest stage) and the drain (the last chunk crossing every stage).
3. `PipelinePredictor` has the single-instance predictor's `predict(n, p)`, so Algorithm 1 compares a group
   with single instances directly (sched/algorithm.py).

Pure: a handful of float operations per chunk and stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.sched.predictors import PrefillTimePredictor
from mooncaked.sched.types import PipelineSpec


def chunk_bounds(num_tokens: int, num_prefix_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[(b_j, e_j)] of the new tokens p..n cut into chunks of at most `chunk_tokens` (at least one chunk)."""
    start = min(max(num_prefix_tokens, 0), max(num_tokens - 1, 0))
    bounds = [(b, min(b + chunk_tokens, num_tokens)) for b in range(start, num_tokens, chunk_tokens)]
    return bounds or [(start, num_tokens)]


def pipeline_seconds(stages: Sequence[PrefillTimePredictor], bounds: Sequence[tuple[int, int]],
                     handoff_s: Sequence[float]) -> float:
    """The recurrence of stage 2 of the module docstring."""
    finish = [0.0] * len(bounds)  # finish[j] of the previous stage
    for s, stage in enumerate(stages):
        handoff = handoff_s[s - 1] if 0 < s <= len(handoff_s) else 0.0
        done = 0.0  # this stage's finish of the previous chunk
        for j, (begin, end) in enumerate(bounds):
            ready = finish[j] + handoff if s else 0.0
            done = max(done, ready) + stage.predict(end, begin)
            finish[j] = done
    return finish[-1] if finish else 0.0


@dataclass(frozen=True)
class PipelinePredictor:
    """Prefill seconds of a group for (prompt tokens, reused prefix tokens), like PrefillTimePredictor."""

    spec: PipelineSpec

    @property
    def stages(self) -> tuple[PrefillTimePredictor, ...]:
        return tuple(PrefillTimePredictor(c) for c in self.spec.stage_coefficients)

    def predict(self, num_tokens: int, num_prefix_tokens: int) -> float:
        bounds = chunk_bounds(num_tokens, num_prefix_tokens, self.spec.chunk_tokens)
        return pipeline_seconds(self.stages, bounds, self.spec.handoff_s)


def split_predictor(whole: PrefillTimePredictor, layer_fractions: Sequence[float]) -> tuple[tuple[float, ...], ...]:
    """Stage coefficients from a whole-model predictor: each stage's share of the layers takes that share of
    the per-token terms, and the whole constant (each stage pays its own per-chunk overhead). For the
    simulator and for defaults before the stages report their own fits."""
    constant, *rest = whole.coefficients
    return tuple((constant, *(c * fraction for c in rest)) for fraction in layer_fractions)


def even_pipeline(whole: PrefillTimePredictor, num_stages: int, chunk_tokens: int,
                  handoff_s: float = 0.0) -> PipelineSpec:
    """A group of `num_stages` stages with equal shares of the layers (split_predictor), each boundary handing a
    chunk over in `handoff_s`: the conductor's model of a group before its stages report their own fits, and
    the simulator's groups."""
    stages = split_predictor(whole, [1.0 / num_stages] * num_stages)
    return PipelineSpec(stages, chunk_tokens, (handoff_s,) * (num_stages - 1) if handoff_s else ())
