"""The output lengths a replica observed, as a few quantiles: what a router
needs to tell how much longer a request already decoding will run.

A mean says nothing of the tail. Chat and agent outputs are heavy-tailed
(Mooncake: median 69 tokens, mean 149, p99 769), so a request that has
decoded past the mean is likely one of the long ones, with more to come,
not nearly done. ``CacheSummary.output_quantiles`` carries
:func:`output_quantiles` of the replica's recent finished requests, and
``router.work_left`` reads the expected rest from them.
"""

from __future__ import annotations

from collections.abc import Iterable

NUM_OUTPUT_QUANTILES = 16  # points a summary carries: ~3 bytes each in JSON
MAX_OUTPUT_QUANTILES = 256  # what a summary may carry at most (a bound against hostile reports)


def output_quantiles(lengths: Iterable[int], num_points: int = NUM_OUTPUT_QUANTILES) -> tuple[int, ...]:
    """``num_points`` output lengths at the probabilities ``(i + 1/2) /
    num_points`` of ``lengths`` (each point stands for an equal share of the
    requests), non-decreasing; ``()`` for no lengths. O(n log n)."""
    if type(num_points) is not int or not 0 < num_points <= MAX_OUTPUT_QUANTILES:
        raise ValueError(f"num_points must be an int in 1..{MAX_OUTPUT_QUANTILES}, got {num_points!r}")
    ordered = sorted(lengths)
    if not ordered:
        return ()
    n = len(ordered)
    return tuple(int(ordered[min(n - 1, int((i + 0.5) * n / num_points))]) for i in range(num_points))


def check_output_quantiles(value: object) -> None:
    """``ValueError`` unless ``value`` is a tuple of at most
    ``MAX_OUTPUT_QUANTILES`` non-negative ints in non-decreasing order."""
    if not isinstance(value, tuple) or len(value) > MAX_OUTPUT_QUANTILES:
        raise ValueError(f"output_quantiles must be a tuple of at most {MAX_OUTPUT_QUANTILES} ints, got {value!r}")
    if any(type(point) is not int or point < 0 for point in value):
        raise ValueError(f"output_quantiles must hold non-negative ints, got {value!r}")
    if any(low > high for low, high in zip(value, value[1:])):
        raise ValueError(f"output_quantiles must be non-decreasing, got {value!r}")


def quantiles_from_wire(value: object) -> tuple[int, ...]:
    """A summary's wire list (JSON array) as the tuple :class:`CacheSummary` holds; checked."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"output_quantiles must be a list, got {type(value).__name__}")
    points = tuple(value)
    check_output_quantiles(points)
    return points
