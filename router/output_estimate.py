"""Expected output length of a request, from what replicas observe."""

from __future__ import annotations


class OutputEstimate:
    """Expected output tokens of a request on a replica: the mean output
    length that replica reports (``CacheSummary.mean_output_tokens``: its
    prefixes' applications; output lengths differ by application), else the
    fleet's mean, capped by the request's ``max_tokens`` (an upper bound,
    never its real length). Before any replica reports:
    ``min(max_tokens, prior_tokens)``; 0 when the request gives no
    ``max_tokens`` either. O(1) per query; a report is O(replicas)."""

    def __init__(self, prior_tokens: int) -> None:
        self.prior_tokens = prior_tokens
        self._replica_to_mean: dict[str, float] = {}  # > 0 only
        self._fleet_mean = 0.0

    def report(self, replica_id: str, mean_output_tokens: float) -> None:
        if mean_output_tokens > 0:
            self._replica_to_mean[replica_id] = float(mean_output_tokens)
            self._refresh()

    def remove(self, replica_id: str) -> None:
        if self._replica_to_mean.pop(replica_id, None) is not None:
            self._refresh()

    def expected(self, max_tokens: int | None, replica_id: str | None = None) -> float:
        """``max_tokens`` None: the replica's (or fleet's) mean alone."""
        mean = self._replica_to_mean.get(replica_id) or self._fleet_mean
        if max_tokens is None:
            return mean
        if not mean:
            return float(min(max_tokens, self.prior_tokens))
        return min(float(max_tokens), mean) if max_tokens else mean

    def _refresh(self) -> None:
        values = self._replica_to_mean.values()
        self._fleet_mean = sum(values) / len(values) if values else 0.0
