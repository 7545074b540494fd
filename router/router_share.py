"""How many routers' worth of traffic the fleet serves, as one router sees it."""

from __future__ import annotations

import math


class RouterShare:
    """``routers()``: the fleet's recent output tokens (the increments of
    every replica's reported ``num_output_tokens_total``) over this router's
    own (its completed requests × the fleet's reported mean output), at least 1.

    With K independent routers splitting the traffic alike, each router
    sees ~1/K of every replica's work, so deviations of its own recent work
    are ~1/K of the real ones, and the work its peers sent a replica since
    its last report is ~(K - 1) × its own. Output tokens, not work, because
    both sides count them alike: a router's own estimate of its requests'
    prefill is off by whatever its index gets wrong about hits, so a work
    ratio drifted to 1.7 with one router (multi-turn, FIFO), where this one
    stays at 1. A ratio below ``min_ratio`` (1.5) reads as 1: with one
    router the two counters disagree by timing alone (summaries lag
    completions by up to a period), up to 1.9 at the 95th percentile of a
    6-second run; so does anything before ``min_completions`` (16) of its
    own requests completed. Both counters decay by ``exp(-age / window_s)``;
    O(1) per event. A replica's first report (or a new epoch, or counters
    that went back) adds nothing.

    Where the routers share their decisions (``router.serve_decisions``),
    the others' are booked as recent work but are no completion of this
    router's, so the ratio still reads how many routers there are;
    :meth:`sees_peers` says the router's recent work covers theirs."""

    def __init__(self, window_s: float, max_routers: float = 64.0, min_ratio: float = 1.5,
                 min_completions: float = 16.0) -> None:
        self.min_completions = float(min_completions)
        self.window_s = float(window_s)
        self.min_ratio = float(min_ratio)
        self.max_routers = float(max_routers)
        self._last_output: dict[str, tuple[str, int]] = {}  # replica -> (epoch, output total)
        self._fleet = (0.0, None)  # (decayed output tokens, as of)
        self._own_count = (0.0, None)  # decayed completions
        self.num_peer_decisions = 0  # other routers' decisions booked here (shared decisions)
        self._peer_seen_s: float | None = None  # when the last one was
        self._asked: tuple[float, float, float] | None = None  # (now, mean output, routers()) until a counter moves

    def _decayed(self, counter: tuple[float, float | None], now: float) -> float:
        value, as_of = counter
        return value if as_of is None else value * math.exp(-max(0.0, now - as_of) / self.window_s)

    def on_report(self, replica_id: str, epoch: str, num_output_total: int, now: float) -> None:
        last = self._last_output.get(replica_id)
        self._last_output[replica_id] = (epoch, num_output_total)
        if last is None or last[0] != epoch or num_output_total < last[1]:
            return
        self._fleet = (self._decayed(self._fleet, now) + (num_output_total - last[1]), now)
        self._asked = None

    def on_completed(self, now: float) -> None:
        self._own_count = (self._decayed(self._own_count, now) + 1.0, now)
        self._asked = None

    def routers(self, now: float, mean_output_tokens: float) -> float:
        """``mean_output_tokens``: the fleet's reported mean output length.
        A decision asks several times at one ``now``: the answer is kept
        until a counter moves."""
        asked = self._asked
        if asked is not None and asked[0] == now and asked[1] == mean_output_tokens:
            return asked[2]
        count = self._decayed(self._own_count, now)
        if mean_output_tokens <= 0.0 or count < self.min_completions:
            value = 1.0
        else:
            ratio = self._decayed(self._fleet, now) / (count * mean_output_tokens)
            value = 1.0 if ratio < self.min_ratio else min(ratio, self.max_routers)
        self._asked = (now, mean_output_tokens, value)
        return value

    def on_peer_decision(self, now: float) -> int:
        """Another router's decision was booked here (it counts as no
        completion of this router's); its serial number, from 1."""
        self.num_peer_decisions += 1
        self._peer_seen_s = now
        return self.num_peer_decisions

    def sees_peers(self, now: float) -> bool:
        """Other routers' decisions reach this router (one within ``window_s``):
        its recent work then covers theirs too."""
        return self._peer_seen_s is not None and now - self._peer_seen_s <= self.window_s

    def remove(self, replica_id: str) -> None:
        self._last_output.pop(replica_id, None)
