"""What a fetch decision weighs (worker/kv_fetch.py, step 2), as measured:
:class:`PrefillRate`, the seconds one more prefilled token adds to a step
(what recomputing a prefix costs), and :class:`TransferModel`, the seconds a
fetch of so many bytes takes (what moving it costs); with the exponentially
weighted mean (:class:`Ewma`) and the least-squares line (:func:`fit_line`)
both are estimated with. Pure: fed by their callers, no clock, no engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

EWMA_WEIGHT = 0.3  # weight of the newest sample in the prefill-rate estimate


@dataclass(slots=True)
class Ewma:
    """An exponentially weighted mean; ``value`` is None before the first sample."""

    weight: float = EWMA_WEIGHT
    value: float | None = None

    def observe(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


def fit_line(samples: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(intercept, slope)`` of ``y`` on ``x`` over ``(x, y)``
    samples, or None unless the largest ``x`` is at least 2x the smallest
    (points too close together fit any slope)."""
    if not samples:
        return None
    xs = [x for x, _ in samples]
    if max(xs) < 2 * min(xs):
        return None
    mean_x, mean_y = sum(xs) / len(samples), sum(y for _, y in samples) / len(samples)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


class PrefillRate:
    """What one more prefilled token adds to a step, in seconds (the cost of
    recomputing a prefix). Fed by the engine thread after each step with the
    stats before and after it; a step counts when at least half of its
    tokens were prefill (decode-heavy steps say little about a prefill).

    A recomputed prefix rides in a step its request runs anyway (for the
    tokens nobody holds), so what it costs is the step's *marginal* time per
    token, not its average: a step has a fixed cost, and a step of a few
    tokens averages many times the marginal one (deploy/config.yaml's
    tiny-llama engine, idle, one thread: a 5-token step 1.5 ms, 0.31 ms a
    token; 300 tokens 4.0 ms; marginal 0.010 ms a token). Once the last ``WINDOW`` counted steps hold sizes at least 2×
    apart, a least-squares line through ``(tokens, seconds)`` gives it (its
    slope, when positive with an intercept of at least 0; else the window's
    seconds ÷ tokens); until then an EWMA of each step's seconds per token.
    """

    WINDOW = 32

    def __init__(self) -> None:
        self._ewma = Ewma()
        self._samples: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)

    @property
    def s_per_token(self) -> float | None:
        samples = tuple(self._samples)  # one copy: the engine thread appends while fetch decisions read
        line = fit_line(samples)
        if line is None:
            return self._ewma.value
        intercept, slope = line
        if slope > 0 and intercept >= 0:
            return slope
        return sum(t for _, t in samples) / sum(n for n, _ in samples)

    def observe_step(self, before: dict, after: dict, elapsed_s: float) -> None:
        prefilled = after["prefill_tokens"] - before["prefill_tokens"]
        decoded = after["decode_tokens"] - before["decode_tokens"]
        if prefilled > 0 and prefilled >= decoded and elapsed_s > 0:
            self._ewma.observe(elapsed_s / (prefilled + decoded))
            self._samples.append((prefilled + decoded, elapsed_s))


class TransferModel:
    """Seconds a fetch of ``n`` bytes takes: ``overhead_s + n / bandwidth``.

    Starts from ``probe_bytes_per_s`` (None: unknown until a fetch completes)
    and ``prior_overhead_s`` (``FetchConfig.prior_overhead_s``), which the
    first completed fetch replaces. Each completed fetch adds ``(bytes, seconds)`` to a
    window of the last ``WINDOW``. Once the window holds sizes at least 2×
    apart, a least-squares line through it gives both terms (if its slope is
    positive; its intercept clamped at 0); until then the bandwidth stays
    the probe's and the overhead is the mean residual ``seconds - bytes /
    bandwidth`` (at least 0), or, with no probe, the samples' own
    bytes ÷ seconds is the bandwidth. Across nodes the network shows up in
    the residuals, then in the fitted slope.
    """

    WINDOW = 32

    def __init__(self, probe_bytes_per_s: float | None = None, prior_overhead_s: float = 0.0) -> None:
        self._probe = probe_bytes_per_s
        self._prior_overhead_s = prior_overhead_s
        self._samples: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def observe(self, num_bytes: int, seconds: float) -> None:
        self._samples.append((num_bytes, seconds))

    def terms(self) -> tuple[float, float] | None:
        """``(overhead_s, bandwidth_bytes_per_s)``; None when nothing is known."""
        samples = self._samples
        line = fit_line(samples)
        if line is not None and line[1] > 0:
            return max(0.0, line[0]), 1.0 / line[1]
        if self._probe is None:
            if not samples:
                return None
            return 0.0, sum(b for b, _ in samples) / max(sum(s for _, s in samples), 1e-9)
        residuals = [max(0.0, s - b / self._probe) for b, s in samples]
        return (sum(residuals) / len(residuals) if residuals else self._prior_overhead_s), self._probe

    def estimate_s(self, num_bytes: int) -> float | None:
        terms = self.terms()
        return None if terms is None else terms[0] + num_bytes / terms[1]
