"""A common base time for values that decay by ``exp(-age / window_s)``."""

from __future__ import annotations

import math

_REBASE_WINDOWS = 50.0  # move the base before exp() of the stored values overflows


class DecayBase:
    """Values stored as ``v · e^{(t - base)/W}`` (``t`` when each was set)
    all read as ``stored · decay(now)``, so one ``exp`` serves every value
    and their sum. The stored values grow as ``e^{(now - base)/W}``:
    :meth:`rebase_if_due` moves the base to ``now`` every
    ``50 × window_s`` and returns the factor the owner multiplies its stored
    values by (None when the base did not move)."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self.base_s: float | None = None

    def decay(self, now: float) -> float:
        return 1.0 if self.base_s is None else math.exp((self.base_s - now) / self.window_s)

    def rebase_if_due(self, now: float) -> float | None:
        if self.base_s is None:
            self.base_s = now
            return None
        if now - self.base_s <= _REBASE_WINDOWS * self.window_s:
            return None
        scale = self.decay(now)
        self.base_s = now
        return scale
