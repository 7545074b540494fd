"""What one output token costs this replica, in prefill-token equivalents,
measured from its own engine steps (the router prices expected output with
it: ``CacheSummary.decode_token_cost`` / ``queue_token_cost``).

Model: one step takes ``seconds = base_s + prefill_token_s × P +
decode_seq_s × D`` for ``P`` prefilled tokens and ``D`` decoding sequences
(``router/batching.py`` ``StepProfile`` without its context term: the
per-sequence coefficient absorbs the contexts this replica's decodes attend
to, the per-token one those of its prefill chunks (a long prompt's later
chunks attend to its earlier ones); ``router/calibrate.py`` fits the full
model offline, over cold single-chunk prompts). The prices follow:

- ``decode_token_cost = (base_s + decode_seq_s) / prefill_token_s``: the busy
  time of a lone decode step (the step's fixed cost plus one sequence's row);
- ``queue_token_cost = decode_seq_s / prefill_token_s``: the delay one
  decoding sequence adds to every step it shares (its row only).

Pure Python (no torch, no numpy): the engine thread observes a step in O(1);
a fit over full windows takes ~0.3 ms (readers run it outside the engine's
locks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

Step = tuple[int, int, float]  # (prefilled tokens, decoding sequences, seconds)
NOT_MEASURED = (0.0, 0.0)
_COLLINEAR = 1e-9  # a Gram matrix whose det ÷ product of its diagonal is below this is singular


@dataclass(frozen=True, slots=True)
class StepFit:
    """Fitted step-time coefficients, each >= 0 (seconds, seconds a prefilled
    token, seconds a decoding sequence)."""

    base_s: float
    prefill_token_s: float
    decode_seq_s: float


class StepCosts:
    """A replica's step-time model, fitted by non-negative least squares (in
    relative error: :func:`fit_nonnegative`) over its recent steps, and the
    two token prices it gives (:meth:`prices`).

    Steps go to one of two bounded windows, the last ``WINDOW`` of each:
    steps with prefill (``P > 0``) and decode-only steps (``P == 0``). Under
    steady load one kind can run for thousands of steps (a long decode
    tail, a burst of prompts); one shared window would then hold only that
    kind, and one kind alone does not identify the three coefficients:
    decode-only steps show no per-token cost, and under a steady batch all
    have the same ``D``, so only the prefill steps' intercept separates the
    base from the per-sequence row. Separate windows keep both kinds, and
    the fit covers both.

    Not measured (``fit()`` None, ``prices()`` ``(0.0, 0.0)``) unless each
    window holds at least ``MIN_SAMPLES`` steps, the prefill window's sizes
    span at least 2x (sizes close together fit any slope) and the fitted
    ``prefill_token_s`` is > 0 (the prices are ratios to it).

    Thread safety: the engine thread calls :meth:`observe` while other
    threads call :meth:`fit` / :meth:`prices`; a reader copies each window
    once (``tuple``), as ``worker.kv_fetch.PrefillRate`` does.
    """

    WINDOW = 128
    MIN_SAMPLES = 8

    def __init__(self) -> None:
        self._prefill_steps: deque[Step] = deque(maxlen=self.WINDOW)
        self._decode_steps: deque[Step] = deque(maxlen=self.WINDOW)

    @property
    def num_samples(self) -> tuple[int, int]:
        """Steps held: ``(with prefill, decode-only)``."""
        return len(self._prefill_steps), len(self._decode_steps)

    def observe(self, num_prefill_tokens: int, num_decode_seqs: int, seconds: float) -> None:
        """One engine step; a step of no tokens or no time says nothing and is ignored."""
        if not seconds > 0 or num_prefill_tokens + num_decode_seqs <= 0:
            return
        window = self._prefill_steps if num_prefill_tokens > 0 else self._decode_steps
        window.append((num_prefill_tokens, num_decode_seqs, seconds))

    def fit(self) -> StepFit | None:
        """The coefficients over both windows, or None while not measured."""
        prefill_steps, decode_steps = tuple(self._prefill_steps), tuple(self._decode_steps)
        if len(prefill_steps) < self.MIN_SAMPLES or len(decode_steps) < self.MIN_SAMPLES:
            return None
        sizes = [p for p, _, _ in prefill_steps]
        if max(sizes) < 2 * min(sizes):
            return None
        base_s, prefill_token_s, decode_seq_s = fit_nonnegative(prefill_steps + decode_steps)
        if not prefill_token_s > 0:
            return None
        return StepFit(base_s, prefill_token_s, decode_seq_s)

    def prices(self) -> tuple[float, float]:
        """``(decode_token_cost, queue_token_cost)``; ``(0.0, 0.0)`` while not measured."""
        fit = self.fit()
        if fit is None:
            return NOT_MEASURED
        return (fit.base_s + fit.decode_seq_s) / fit.prefill_token_s, fit.decode_seq_s / fit.prefill_token_s


def fit_nonnegative(steps: Sequence[Step]) -> tuple[float, float, float]:
    """Non-negative least squares of ``seconds`` (each > 0) on ``(1, P, D)``, in
    relative error: ``(base_s, prefill_token_s, decode_seq_s)``, each >= 0
    (all 0 for no steps).

    Relative error (each step weighted by ``1 / seconds``, as
    ``router/calibrate.py`` fits): a step's jitter grows with its length,
    so in absolute seconds a few long prefill steps would outweigh every
    short decode-only one, and with them the per-sequence row a decode-only
    step shows. On deploy/config.yaml's tiny-llama engine, 4 requests at a
    time, the plain fit put that row at 0 in most runs; this one at
    ~120-140 µs, near what more concurrency shows either way.

    Active set by enumeration: the NNLS optimum is the ordinary least-squares
    solution on the subset of coefficients it leaves positive, so solving
    every subset (normal equations; collinear subsets skipped), keeping the
    solutions with no negative coefficient and taking the one of the lowest
    residual sum of squares finds it. Three unknowns make 7 subsets."""
    rows = [(1.0 / s, p / s, d / s) for p, d, s in steps]  # each row and its target (1) divided by the seconds
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    moments = [sum(r[i] for r in rows) for i in range(3)]
    sum_squares = float(len(rows))

    best, best_rss = (0.0, 0.0, 0.0), sum_squares  # the empty subset: predict 0
    for size in (1, 2, 3):
        for subset in combinations(range(3), size):
            solution = _solve([[gram[i][j] for j in subset] for i in subset], [moments[i] for i in subset])
            if solution is None or min(solution) < 0:
                continue
            coef = [0.0, 0.0, 0.0]
            for index, value in zip(subset, solution):
                coef[index] = value
            # RSS = y·y - 2 c·Xᵀy + c·XᵀX·c, from the sums above (no second pass over the steps)
            rss = sum_squares - 2 * sum(c * m for c, m in zip(coef, moments)) \
                + sum(coef[i] * gram[i][j] * coef[j] for i in range(3) for j in range(3))
            if rss < best_rss:
                best, best_rss = tuple(coef), rss
    return best


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """``matrix⁻¹ rhs`` for a small Gram matrix (Gaussian elimination, partial
    pivoting), or None when it is singular: its determinant over the product
    of its diagonal (in [0, 1] for a Gram matrix; 0 for collinear columns)
    is below ``_COLLINEAR``."""
    size = len(rhs)
    diagonal = 1.0
    for i in range(size):
        diagonal *= matrix[i][i]
    if not diagonal > 0:
        return None  # an all-zero column
    a = [row[:] + [b] for row, b in zip(matrix, rhs)]
    determinant = 1.0
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        if pivot != col:
            a[col], a[pivot] = a[pivot], a[col]
            determinant = -determinant
        determinant *= a[col][col]
        if a[col][col] == 0:
            return None
        for row in range(col + 1, size):
            factor = a[row][col] / a[col][col]
            for k in range(col, size + 1):
                a[row][k] -= factor * a[col][k]
    if abs(determinant) / diagonal < _COLLINEAR:
        return None
    solution = [0.0] * size
    for row in reversed(range(size)):
        solution[row] = (a[row][size] - sum(a[row][k] * solution[k] for k in range(row + 1, size))) / a[row][row]
    return solution
