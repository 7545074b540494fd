"""Several routers sharing their decisions: what one sends, and the shared log.

Each Ingress replica runs its own request router, which otherwise learns of
the others' decisions only from the replicas' summaries, a period or more
later. A chat whose next turn reaches another router ~30 ms after the last
answer then finds that router knowing nothing of where the chat went
(BENCHMARKS.md, "What each Ingress's router reads"). Routers that share
their decisions through a :class:`DecisionLog` (live: one Ray actor per
application, ``router.serve_decisions``) book each other's decisions as
their own recent work (``PrefixAffinityPolicy.on_peer_routed``). Pure Python.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from itertools import islice, takewhile
from typing import NamedTuple

from router.request import RoutingRequest


class PeerDecision(NamedTuple):
    """One routed request as another router books it: the request without its
    token ids and text (a prompt's worth per decision would be most of what
    routers exchange), and the tokens past its last full block, which the
    receiving router learns as the prompt's partial last block."""

    replica_id: str
    request: RoutingRequest
    tail_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, request: object, replica_id: str, block_size: int) -> PeerDecision | None:
        """What a router sends for ``request`` routed to ``replica_id``; None
        for a request without usable routing attributes."""
        try:
            routing = RoutingRequest.from_object(request)
        except ValueError:
            return None
        tail = tuple(routing.token_ids[len(routing.block_hashes) * block_size:])
        return cls(replica_id, dataclasses.replace(routing, token_ids=(), prompt=""), tail)

    def to_wire(self) -> tuple:
        """Plain values in a tuple (what routers exchange: cheaper to pickle than the objects)."""
        request = self.request
        return (self.replica_id, request.block_hashes, request.num_prompt_tokens, request.num_output_tokens,
                request.salt, self.tail_token_ids)

    @classmethod
    def from_wire(cls, wire: tuple) -> PeerDecision:
        replica_id, hashes, num_prompt_tokens, num_output_tokens, salt, tail = wire
        return cls(replica_id, RoutingRequest(tuple(hashes), num_prompt_tokens, salt,
                                              num_output_tokens=num_output_tokens), tuple(tail))


class DecisionLog:
    """The routers' shared log: each :meth:`exchange` appends one router's
    decisions since its last exchange and returns the others' appended since
    then. Holds the last ``max_events`` (a router that stayed away longer
    misses the oldest: it only learns less). A router's first exchange
    (``since`` None) gets the others' events of the last ``join_window_s``
    (by the board's clock ``now``): a router starts exchanging with its
    first routed request, and the others' decisions just before it are the
    ones its next requests need; older history it does not book.

    Invariant: ``next_seq - len(events)`` is the sequence number of the
    oldest event held; events carry consecutive numbers."""

    def __init__(self, max_events: int = 8192, join_window_s: float = 2.0) -> None:
        if type(max_events) is not int or max_events <= 0:
            raise ValueError(f"max_events must be a positive int, got {max_events!r}")
        if not 0 <= join_window_s < float("inf"):
            raise ValueError(f"join_window_s must be a finite number >= 0, got {join_window_s!r}")
        self.join_window_s = float(join_window_s)
        self._events: deque[tuple[float, str, object]] = deque(maxlen=max_events)  # (time, sender, event)
        self.next_seq = 0
        self.num_missed = 0  # events a router asked for after the log had dropped them

    def exchange(self, router_id: str, events: list, since: int | None, now: float) -> tuple[list, int]:
        """Append ``events`` (``router_id``'s, at ``now``); return ``(the other
        routers' events numbered ``since`` or later, the number to ask from
        next)``."""
        oldest = self.next_seq - len(self._events)
        if since is None:
            start = sum(1 for _ in takewhile(lambda e: e[0] < now - self.join_window_s, self._events))
        else:
            if since < oldest:
                self.num_missed += oldest - since
            start = max(since, oldest) - oldest
        found = [event for _, sender, event in islice(self._events, start, None) if sender != router_id]
        for event in events:
            self._events.append((now, router_id, event))
        self.next_seq += len(events)
        return found, self.next_seq

    def __len__(self) -> int:
        return len(self._events)
