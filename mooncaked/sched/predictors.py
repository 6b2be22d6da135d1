"""Time predictors of Algorithm 1 (paper sections 2.2 and 4.1): prefill, queue, transfer and decode step time.

1. Defaults come from the model and hardware: prefill follows `flops(n) = l(a n^2 d + b n d^2)` (Eq. 1) at a
   GPU throughput and model-FLOPs utilisation; a decode step reads the weights and every running request's KV.
2. `fit(samples)` replaces a default with a least-squares fit of measured samples (profiling at start-up or a
   profile file): prefill is a degree-2 polynomial in (n, p), decode step time is linear in (batch, context).
3. The scheduler evaluates them per candidate instance; each prediction is a handful of float operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.sched.types import PrefillInstanceView

_TOKEN_SCALE = 1e-3  # features in thousands of tokens keep the normal equations well conditioned


def least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float], ridge: float = 1e-9) -> list[float]:
    """Coefficients minimising |rows @ c - targets|^2 (normal equations, Gaussian elimination with pivoting)."""
    if not rows or len(rows) != len(targets):
        raise ValueError(f"need equally many rows and targets, got {len(rows)} and {len(targets)}")
    size = len(rows[0])
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(size)] for i in range(size)]
    rhs = [sum(r[i] * t for r, t in zip(rows, targets)) for i in range(size)]
    for i in range(size):
        gram[i][i] += ridge * (1.0 + gram[i][i])
    for col in range(size):
        pivot = max(range(col, size), key=lambda row: abs(gram[row][col]))
        if abs(gram[pivot][col]) < 1e-300:
            raise ValueError("samples do not determine the model: vary prompt and prefix lengths more")
        gram[col], gram[pivot] = gram[pivot], gram[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        for row in range(col + 1, size):
            factor = gram[row][col] / gram[col][col]
            for j in range(col, size):
                gram[row][j] -= factor * gram[col][j]
            rhs[row] -= factor * rhs[col]
    coefficients = [0.0] * size
    for row in reversed(range(size)):
        tail = sum(gram[row][j] * coefficients[j] for j in range(row + 1, size))
        coefficients[row] = (rhs[row] - tail) / gram[row][row]
    return coefficients


def _least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float], relative: bool) -> list[float]:
    if not relative:
        return least_squares(rows, targets)
    if any(t <= 0 for t in targets):
        raise ValueError("a relative fit needs positive times")
    return least_squares([[x / t for x in row] for row, t in zip(rows, targets)], [1.0] * len(targets))


def _nonnegative_fit(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Relative least squares with every coefficient but the first (the constant) >= 0: a coefficient that comes
    out negative is fixed at 0 and the others refitted (an active set of at most len(row) - 1 rounds)."""
    free = list(range(len(rows[0])))
    while True:
        coefficients = [0.0] * len(rows[0])
        fitted = _least_squares([[row[i] for i in free] for row in rows], targets, relative=True)
        for i, value in zip(free, fitted):
            coefficients[i] = value
        negative = [i for i in free[1:] if coefficients[i] < 0]
        if not negative:
            return coefficients
        free.remove(min(negative, key=lambda i: coefficients[i]))


def _prefill_features(num_tokens: int, num_prefix_tokens: int) -> tuple[float, ...]:
    n = num_tokens * _TOKEN_SCALE
    p = min(num_prefix_tokens, num_tokens) * _TOKEN_SCALE
    return (1.0, n, p, n * n, n * p, p * p)


@dataclass(frozen=True)
class PrefillTimePredictor:
    """Prefill seconds = c . (1, n, p, n^2, n p, p^2), n and p in thousands of tokens (p: reused prefix)."""

    coefficients: tuple[float, ...]

    @classmethod
    def from_model(
        cls,
        *,
        num_layers: int,
        hidden_size: int,
        gpu_flops: float,
        mfu: float = 0.5,
        a: float = 4.0,
        b: float = 22.0,
        overhead_s: float = 0.0,
    ) -> PrefillTimePredictor:
        """Eq. 1 for the new tokens: l(a d (n^2 - p^2) + b d^2 (n - p)) FLOPs at `gpu_flops * mfu`."""
        if gpu_flops <= 0 or not 0 < mfu <= 1:
            raise ValueError(f"need gpu_flops > 0 and 0 < mfu <= 1, got {gpu_flops}, {mfu}")
        scale = num_layers / (gpu_flops * mfu)
        quadratic = scale * a * hidden_size / (_TOKEN_SCALE**2)
        linear = scale * b * hidden_size * hidden_size / _TOKEN_SCALE
        return cls((overhead_s, linear, -linear, quadratic, 0.0, -quadratic))

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]], *, relative: bool = False) -> PrefillTimePredictor:
        """Least squares over (prompt tokens, prefix tokens, seconds) samples; needs at least 6 distinct ones.

        relative: minimise relative rather than absolute errors (short prompts count as much as long ones).
        """
        if len(samples) < 6:
            raise ValueError(f"need at least 6 prefill samples to fit, got {len(samples)}")
        rows = [_prefill_features(n, p) for n, p, _ in samples]
        return cls(tuple(_least_squares(rows, [seconds for _, _, seconds in samples], relative)))

    @classmethod
    def fit_paper_form(cls, samples: Sequence[tuple[int, int, float]]) -> PrefillTimePredictor:
        """Relative least squares of Eq. 1's shape over the new tokens: c0 + alpha (n - p) + beta (n^2 - p^2),
        with alpha, beta >= 0 (a negative term is dropped and the rest refitted). Three coefficients extrapolate
        from a short profile where the general six-term polynomial would not."""
        if len(samples) < 3:
            raise ValueError(f"need at least 3 prefill samples to fit, got {len(samples)}")
        rows = [(1.0, (n - p) * _TOKEN_SCALE, (n * n - p * p) * _TOKEN_SCALE**2) for n, p in
                ((n, min(p, n)) for n, p, _ in samples)]
        c0, alpha, beta = _nonnegative_fit(rows, [seconds for _, _, seconds in samples])
        return cls((c0, alpha, -alpha, beta, 0.0, -beta))

    def predict(self, num_tokens: int, num_prefix_tokens: int) -> float:
        c = self.coefficients
        n = num_tokens * _TOKEN_SCALE
        p = min(num_prefix_tokens, num_tokens) * _TOKEN_SCALE
        seconds = c[0] + c[1] * n + c[2] * p + c[3] * n * n + c[4] * n * p + c[5] * p * p
        return max(seconds, 0.0)


@dataclass(frozen=True)
class DecodeStepPredictor:
    """Decode step (= TBT) seconds = c0 + c1 * batch size + c2 * total context tokens (in thousands)."""

    coefficients: tuple[float, float, float]

    @classmethod
    def from_model(
        cls,
        *,
        weight_bytes: float,
        kv_bytes_per_token: float,
        hbm_bandwidth: float,
        bandwidth_utilisation: float = 0.6,
        per_request_s: float = 0.0,
        overhead_s: float = 0.0,
    ) -> DecodeStepPredictor:
        """Memory-bound step: read all weights and every running token's KV once per step."""
        if hbm_bandwidth <= 0 or not 0 < bandwidth_utilisation <= 1:
            raise ValueError(f"need hbm_bandwidth > 0 and 0 < utilisation <= 1, got {hbm_bandwidth}")
        effective = hbm_bandwidth * bandwidth_utilisation
        return cls((overhead_s + weight_bytes / effective, per_request_s, kv_bytes_per_token / effective / _TOKEN_SCALE))

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]], *, relative: bool = False) -> DecodeStepPredictor:
        """Least squares over (batch size, context tokens, step seconds) samples; needs at least 3.

        relative: minimise relative rather than absolute errors, with the per-request and per-token terms >= 0.
        """
        if len(samples) < 3:
            raise ValueError(f"need at least 3 decode samples to fit, got {len(samples)}")
        rows = [(1.0, float(batch), tokens * _TOKEN_SCALE) for batch, tokens, _ in samples]
        if relative:
            c0, c1, c2 = _nonnegative_fit(rows, [seconds for _, _, seconds in samples])
        else:
            c0, c1, c2 = least_squares(rows, [seconds for _, _, seconds in samples])
        return cls((c0, c1, c2))

    def predict(self, batch_size: int, num_context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        c0, c1, c2 = self.coefficients
        return max(c0 + c1 * batch_size + c2 * num_context_tokens * _TOKEN_SCALE, 0.0)


@dataclass(frozen=True)
class TransferTimePredictor:
    """KV transfer seconds for a number of blocks over one link: latency + bytes / bandwidth."""

    bytes_per_block: int
    bandwidth: float  # bytes per second
    latency_s: float = 0.0

    def predict(self, num_blocks: int, bandwidth: float = 0.0) -> float:
        """`bandwidth`: the link's measured bytes per second (0: the configured one)."""
        if num_blocks <= 0:
            return 0.0
        return self.latency_s + num_blocks * self.bytes_per_block / (bandwidth if bandwidth > 0 else self.bandwidth)


def queue_time_s(view: PrefillInstanceView, now: float) -> float:
    """EstimatePrefillQueueTime: the rest of the running prefill plus the predicted prefills queued behind it."""
    return max(view.busy_until - now, 0.0) + view.queued_prefill_s


@dataclass(frozen=True)
class Predictors:
    """The predictors one scheduler instance uses."""

    prefill: PrefillTimePredictor
    decode: DecodeStepPredictor
    transfer: TransferTimePredictor
