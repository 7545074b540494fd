"""The background thread behind :class:`~worker.async_engine.AsyncEngine`.

It owns the :class:`~worker.engine.Engine`: it takes submissions and
cancellations from an inbox, steps the engine (torch releases the GIL during
the forward), and hands each step's events to the event loop each request
came from, one ``call_soon_threadsafe`` per loop per step, into the
request's :class:`RequestSink`. After each step it keeps a snapshot of the
engine's stats and feeds what the step did and took to the measurements the
asyncio side reports (prefill rate, step costs, output lengths).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from worker.config import EngineConfig
from worker.engine import Engine
from worker.fetch_estimates import PrefillRate
from worker.results import GenerationResult, TokenEvent
from worker.step_costs import StepCosts

logger = logging.getLogger("worker.async_engine")  # the engine thread's records keep the name they always had
OUTPUT_WINDOW = 64  # finished requests whose output lengths the cache summary averages


@dataclass(slots=True, eq=False)
class RequestSink:
    """Where a request's items go: a queue on the submitting event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    wants_tokens: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    is_done: bool = False  # result or error handed over (engine thread side)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set on the loop when the last item is queued


class EngineThread:
    """An :class:`Engine` stepped by a background thread: the state the
    thread shares with the asyncio side (its subclass
    :class:`~worker.async_engine.AsyncEngine`, whose docstring states the
    invariants, the locks and their order) and the thread's own loop.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine: Engine | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine if engine is not None else Engine(config)
        self.config = self.engine.config
        self._clock = clock
        self._lock = threading.RLock()
        self._cache_lock = threading.RLock()
        self.engine.forward_window = self._forward_window
        self._sinks_lock = threading.Lock()
        self._sinks: dict[str, RequestSink] = {}
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._closed = False
        self._step_failed = False
        self._snapshot = self.engine.stats
        self._output_lengths: deque[int] = deque(maxlen=OUTPUT_WINDOW)  # engine thread appends
        self._num_output_tokens_total = 0  # tokens of every finished request (engine thread)
        self._busy_s_total = 0.0  # seconds spent in steps that had work (engine thread)
        self._prefill_rate = PrefillRate()  # engine thread observes; fetch decisions read
        self._step_costs = StepCosts()  # engine thread observes; cache summaries read
        self._thread = threading.Thread(target=self._run, name="kvroute-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- inbox
    def _cancel(self, sink: RequestSink) -> None:
        """Queue an abort for the engine thread unless the request has ended (either side calls it)."""
        if not sink.is_done:
            self._inbox.append(("abort", sink.request_id))
            self._wakeup.set()

    # ------------------------------------------------------------ engine side
    def _run(self) -> None:
        while True:
            if not self._inbox and not self._closed and not self.engine.has_work():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            deliveries: list[tuple[RequestSink, object]] = []
            with self._exclusive():
                self._drain_inbox(deliveries)
                if self._closed:
                    self._fail_all(RuntimeError("the engine shut down"), deliveries)
                    self._deliver(deliveries)
                    return
                try:
                    started_s = self._clock()
                    had_work = self.engine.has_work()
                    events = self.engine.step() if had_work else []
                    if self.engine.has_work() and not self.engine.last_step_ran:
                        raise RuntimeError(f"no progress with {self.engine.scheduler.num_waiting} waiting")
                    self._step_failed = False
                except Exception as error:  # a bug: fail what is in flight, keep serving
                    logger.exception("engine step failed; failing in-flight requests")
                    self._step_failed = True
                    had_work, events = False, []
                    self._fail_all(RuntimeError(f"engine step failed: {error!r}"), deliveries)
                self._route(events, deliveries)
                previous, self._snapshot = self._snapshot, self.engine.stats
                elapsed_s = self._clock() - started_s
                if had_work:
                    self._busy_s_total += elapsed_s
                self._prefill_rate.observe_step(previous, self._snapshot, elapsed_s)
                self._step_costs.observe(  # each decoding sequence makes one token a step
                    self._snapshot["prefill_tokens"] - previous["prefill_tokens"],
                    self._snapshot["decode_tokens"] - previous["decode_tokens"], elapsed_s)
            self._deliver(deliveries)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Both locks: nothing else reads or changes the engine or its cache."""
        with self._lock, self._cache_lock:
            yield

    @contextlib.contextmanager
    def _forward_window(self) -> Iterator[None]:
        """The engine thread, in a step: lets cache readers and importers in during the forward."""
        self._cache_lock.release()
        try:
            yield
        finally:
            self._cache_lock.acquire()

    def _drain_inbox(self, deliveries: list) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] == "abort":
                self.engine.abort(command[1])
                continue
            _, request_id, prompt, params, salt, arrival_s = command
            with self._sinks_lock:
                sink = self._sinks.get(request_id)
            if sink is None or sink.is_done:  # cancelled before it was queued
                continue
            try:
                self.engine.add_validated(prompt, params, salt=salt, request_id=request_id, arrival_s=arrival_s)
            except ValueError as error:
                sink.is_done = True
                deliveries.append((sink, error))

    def _route(self, events: list[TokenEvent], deliveries: list) -> None:
        with self._sinks_lock:
            for event in events:
                sink = self._sinks.get(event.request_id)
                if sink is None or sink.is_done:
                    continue
                if sink.wants_tokens:
                    deliveries.append((sink, event))
                if event.result is not None:
                    self._output_lengths.append(len(event.result.token_ids))
                    self._num_output_tokens_total += len(event.result.token_ids)
                    sink.is_done = True
                    deliveries.append((sink, event.result))

    def _fail_all(self, error: BaseException, deliveries: list) -> None:
        with self._sinks_lock:
            sinks = [s for s in self._sinks.values() if not s.is_done]
        for sink in sinks:
            self.engine.abort(sink.request_id)
            sink.is_done = True
            deliveries.append((sink, error))

    def _deliver(self, deliveries: list[tuple[RequestSink, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sink, item in deliveries:
            by_loop.setdefault(sink.loop, []).append((sink, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is waiting any more
                for sink, _ in items:
                    self._cancel(sink)


def _put_all(items: list[tuple[RequestSink, object]]) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)
        if isinstance(item, (GenerationResult, BaseException)):
            sink.ended.set()
