"""Binary search along a chain of block hashes: whoever holds block ``j``
of a chain holds blocks ``0..j`` too, so "held up to depth d" is true up
to some depth and false after it."""

from __future__ import annotations

from collections.abc import Callable


def last_true(n: int, predicate: Callable[[int], bool]) -> int:
    """Largest ``d`` in ``1..n`` with ``predicate(d)``, for a predicate that is
    true up to some point and false after it; 0 if ``predicate(1)`` is false."""
    if n <= 0 or not predicate(1):
        return 0
    low, high = 1, n + 1  # predicate(low) holds; predicate(high) fails or is out of range
    while high - low > 1:
        mid = (low + high) // 2
        if predicate(mid):
            low = mid
        else:
            high = mid
    return low
