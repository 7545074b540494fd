"""Closed-loop arrivals for the simulator, as the live load test sends them.

``python -m harness.loadtest --mode closed --concurrency N`` runs N client
workers; each takes the next session from one queue, in order, and sends its
turns one after another: turn ``k + 1`` goes out when turn ``k``'s stream
has ended, and when a session's last turn ends the worker takes the next
session. The load test has no think time. :class:`ClosedLoop` issues a
workload's requests the same way, so a simulated replica sees the live
app's load: never more than N requests in flight, each sent when an earlier
one completes, whatever the engine's speed.

Between the engine finishing a request and the engine receiving the same
session's next one lie the client's ``think_s`` (0 for the load test) and
the request's trip through the HTTP proxy, the ingress and the Ray call and
back: ``ingress_s``, measured live as the client's TTFT less the engine's
own (``harness.loadstats``: ``ingress_overhead_s``), never fitted. The same
``ingress_s`` is what a client's TTFT adds to the engine's, so
:func:`client_ttft` shifts the simulated figures by it. With
``ingress_samples_s`` (a live run's per-request figures) each send's trip
is drawn from them instead, the workers' first requests included: live,
those reach the engine spread over the ingress's tens of milliseconds, not
at one instant (a burst that all arrives at once makes the engine defer
every prompt sharing the first one's prefix for a whole prefill step).

The simulator advances in ticks of ``tick_s``: a request whose engine arrival
falls inside a tick is sent at the tick's end, after every completion up to
then is known (its TTFT is counted from there), so a session's next turn is
late by less than one tick. Invariants (checked by :meth:`ClosedLoop.check_invariants`
and the tests): at most ``concurrency`` requests are in flight or waiting to
be sent; each session's turns go out in order, each after its predecessor's
completion plus the gap; every request is sent exactly once.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

LOADTEST_THINK_S = 0.0  # harness.loadtest sends a session's next turn as soon as the last one ended


@dataclass(frozen=True, slots=True)
class ClosedLoopConfig:
    """The simulator's closed-loop arrivals (``SimConfig.closed_loop``):
    ``concurrency`` client workers, ``think_s`` and ``ingress_s`` between a
    completion and the session's next request at the engine, ``tick_s`` the
    time step (a turn is late by less than one)."""

    concurrency: int = 8
    think_s: float = LOADTEST_THINK_S
    ingress_s: float = 0.0
    tick_s: float = 0.0005
    # each send's trip drawn from these (a live run's own ingress_overhead_s), seeded; empty: ingress_s for every
    ingress_samples_s: tuple[float, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if type(self.concurrency) is not int or self.concurrency <= 0:
            raise ValueError(f"concurrency must be a positive int, got {self.concurrency!r}")
        for name in ("think_s", "ingress_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.tick_s, (int, float)) and math.isfinite(self.tick_s) and self.tick_s > 0):
            raise ValueError(f"tick_s must be a positive number, got {self.tick_s!r}")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in self.ingress_samples_s):
            raise ValueError("ingress_samples_s must be finite numbers >= 0")

    def loop(self, sessions: Sequence[Sequence[int]], start_s: float = 0.0) -> ClosedLoop:
        draw = None
        if self.ingress_samples_s:
            rng, samples = random.Random(self.seed), self.ingress_samples_s
            draw = lambda: rng.choice(samples)  # noqa: E731
        return ClosedLoop(sessions, self.concurrency, think_s=self.think_s, ingress_s=self.ingress_s,
                          start_s=start_s, draw_ingress_s=draw)


class ClosedLoop:
    """``concurrency`` client workers over ``sessions`` (each a sequence of
    request numbers, sent in order). Call :meth:`due` for the requests to
    send by a time and :meth:`on_completed` for each completion."""

    def __init__(self, sessions: Sequence[Sequence[int]], concurrency: int, *, think_s: float = 0.0,
                 ingress_s: float = 0.0, start_s: float = 0.0,
                 draw_ingress_s: Callable[[], float] | None = None) -> None:
        if type(concurrency) is not int or concurrency <= 0:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        for name, value in (("think_s", think_s), ("ingress_s", ingress_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        numbers = [n for session in sessions for n in session]
        if len(set(numbers)) != len(numbers):
            raise ValueError("a request number appears in more than one turn")
        self.concurrency = concurrency
        self.gap_s = think_s + ingress_s  # engine finish -> the session's next request at the engine
        self._think_s, self._draw = think_s, draw_ingress_s  # with a draw, each gap is think_s + a draw
        self._queue: deque[deque[int]] = deque(deque(s) for s in sessions if len(s))
        self._scheduled: list[tuple[float, int, int]] = []  # heap (send at, order, request number)
        self._session_of: dict[int, deque[int]] = {}  # in flight: request -> the rest of its session
        self._order = 0
        self.num_sent = 0
        self.num_total = len(numbers)
        for _ in range(min(concurrency, len(self._queue))):  # the workers' first requests, each its own trip
            self._schedule(self._queue.popleft(), start_s + (self._draw() if self._draw is not None else 0.0))

    def _schedule(self, session: deque[int], at_s: float) -> None:
        number = session.popleft()
        heapq.heappush(self._scheduled, (at_s, self._order, number))
        self._order += 1
        self._session_of[number] = session

    def due(self, now: float) -> list[int]:
        """Request numbers to send by ``now``, in send order (removed from the schedule)."""
        sent = []
        while self._scheduled and self._scheduled[0][0] <= now:
            sent.append(heapq.heappop(self._scheduled)[2])
        self.num_sent += len(sent)
        return sent

    def on_completed(self, number: int, finish_s: float) -> None:
        """Request ``number`` ended at ``finish_s``: its worker sends the
        session's next turn, or the next session's first, ``gap_s`` later."""
        session = self._session_of.pop(number, None)
        if session is None:
            raise ValueError(f"request {number} is not in flight")
        if not session and self._queue:
            session = self._queue.popleft()
        if session:
            gap_s = self.gap_s if self._draw is None else self._think_s + self._draw()
            self._schedule(session, finish_s + gap_s)

    @property
    def next_send_s(self) -> float | None:
        """When the earliest scheduled request goes out (None: nothing scheduled)."""
        return self._scheduled[0][0] if self._scheduled else None

    @property
    def num_scheduled(self) -> int:
        """Scheduled and not yet sent."""
        return len(self._scheduled)

    @property
    def num_in_flight(self) -> int:
        """Sent and not completed, or scheduled and not yet sent."""
        return len(self._session_of)

    @property
    def done(self) -> bool:
        return not self._session_of and not self._queue

    def check_invariants(self) -> None:
        assert self.num_in_flight <= self.concurrency, "more sessions active than client workers"
        assert len(self._scheduled) <= self.num_in_flight
        assert self.num_sent <= self.num_total


def arrivals(loop: ClosedLoop, catch_up: Callable[[float], Sequence], tick_s: float,
             start_s: float = 0.0) -> Iterator[tuple[int, float]]:
    """``(request number, send time)`` in time order, for the simulator's replay.

    ``catch_up(t)`` runs the simulated cluster to ``t`` (summaries due, then
    the replicas) and returns the completions up to ``t`` (objects with
    ``number`` and ``finish_s``), which the loop hears before anything is
    sent at ``t``. Time moves a tick at a time while requests are in flight,
    and jumps to the next send when the cluster is idle."""
    if not (isinstance(tick_s, (int, float)) and tick_s > 0 and math.isfinite(tick_s)):
        raise ValueError(f"tick_s must be a positive number, got {tick_s!r}")
    now = start_s
    while not loop.done:
        for number in loop.due(now):
            yield number, now
        idle = loop.num_in_flight == loop.num_scheduled  # every request sent so far has completed
        next_send = loop.next_send_s
        if idle and next_send is not None:
            now = max(now + tick_s, tick_s * math.ceil(next_send / tick_s))
        else:
            now += tick_s
        for completion in sorted(catch_up(now), key=lambda c: c.finish_s):
            loop.on_completed(completion.number, completion.finish_s)


def client_ttft(engine_ttft_s: float, ingress_s: float) -> float:
    """A client's TTFT: the engine's plus the trip through proxy, ingress and back."""
    return engine_ttft_s + ingress_s
