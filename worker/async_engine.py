"""asyncio interface to the engine, for the serving layer.

One background thread owns the :class:`~worker.engine.Engine`
(:class:`~worker.engine_thread.EngineThread`, which :class:`AsyncEngine`
extends with the asyncio API): it takes submissions and cancellations from
an inbox, steps the engine (torch releases the GIL during the forward), and
hands each step's events to the event loop each request came from, one
``call_soon_threadsafe`` per loop per step. Callers on any number of event
loops may submit and cancel at once.

Per request::

    result = await engine.generate(prompt_ids, params, salt=..., request_id=...)
    async for item in engine.stream(prompt_ids, params):
        ...  # TokenEvent per token, then the GenerationResult as the last item

Cancelling the awaiting task, or closing the stream early (``aclose()``,
``break`` then garbage collection), cancels the request: the engine thread
aborts it at the start of its next step and its blocks return to the pool.
Bad input raises ``ValueError`` before anything is queued; a full queue
(``max_queued_requests`` not yet running) raises :class:`EngineOverloaded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

from cache.output_quantiles import output_quantiles
from cache.summary import CacheSummary, cached_block_hashes
from worker.config import EngineConfig  # noqa: F401 - re-exported
from worker.engine import Engine
from worker.engine_thread import OUTPUT_WINDOW, EngineThread, RequestSink, logger  # noqa: F401 - re-exported
from worker.fetch_estimates import PrefillRate  # noqa: F401 - re-exported
from worker.results import EngineOverloaded, GenerationResult, TokenEvent
from worker.sampling import SamplingParams
from worker.step_costs import StepCosts  # noqa: F401 - re-exported

__all__ = ["AsyncEngine", "EngineOverloaded"]


class AsyncEngine(EngineThread):
    """An :class:`Engine` stepped by a background thread
    (:class:`~worker.engine_thread.EngineThread`: the state, the thread's loop).

    Invariants (:meth:`check_invariants`): the engine's own, and every request
    the engine holds has a live sink (a waiter), so nothing runs unobserved.

    Locks: ``_lock`` (the engine: scheduler, requests) and ``_cache_lock``
    (the KV cache: radix tree, allocator, the rows of cached blocks). Whoever
    changes engine state holds both (:meth:`_exclusive`); the engine thread
    holds both through a step except during the model forward, when it
    holds ``_lock`` only (``Engine.forward_window``): the forward reads the
    tree and allocator nowhere and writes only rows of blocks its sequences
    hold alone, so exports, imports and cache lookups
    (:meth:`export_prefix`, :meth:`import_prefix`, :meth:`cached_prefix_tokens`,
    :meth:`in_flight_prefix_tokens`) take ``_cache_lock`` alone and run while
    the forward does, instead of waiting for the step to end; the engine
    thread waits for them at most one bounded copy after its forward.
    Order: ``_lock``, then ``_cache_lock``, then ``_sinks_lock``; never the reverse.
    """

    # ------------------------------------------------------------ passthrough
    @property
    def cache(self):
        return self.engine.cache

    @property
    def allocator(self):
        return self.engine.allocator

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    def model_info(self) -> dict:
        eos = self.engine.eos_token_ids
        return {
            "model_id": self.model_id,
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "eos_token_id": eos[0] if eos else None,
            "eos_token_ids": list(eos),
            "block_size": self.config.block_size,
            "deterministic": self.config.deterministic,
        }

    # --------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> None:
        """ValueError naming the problem if the request cannot be served."""
        self.engine.validate(prompt_token_ids, params if params is not None else SamplingParams())

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        salt: str | None = None,
        request_id: str | None = None,
    ) -> GenerationResult:
        sink = self._submit(prompt_token_ids, params, salt, request_id, wants_tokens=False)
        try:
            item = await sink.queue.get()
        except BaseException:
            self._cancel(sink)
            raise
        finally:
            self._forget(sink)
        if isinstance(item, BaseException):
            raise item
        return item

    async def stream(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        salt: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[TokenEvent | GenerationResult]:
        """Yields a :class:`TokenEvent` per generated token, then the
        :class:`GenerationResult` (``.done`` is True) as the last item."""
        async with contextlib.aclosing(self.stream_chunks(prompt_token_ids, params, salt=salt,
                                                          request_id=request_id)) as chunks:
            async for chunk in chunks:
                for item in chunk:
                    yield item

    async def stream_chunks(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        salt: str | None = None,
        request_id: str | None = None,
        interval_s: float = 0.0,
    ) -> AsyncIterator[list[TokenEvent | GenerationResult]]:
        """:meth:`stream`'s items in lists: each list holds every item that
        had arrived when it was taken, so a consumer slower than the engine
        gets fewer, larger messages instead of falling behind one token at a
        time.

        ``interval_s`` > 0 also spaces the lists: after one, the next is
        taken no sooner than ``interval_s`` later (tokens gather meanwhile),
        except that the first token and the result go out as soon as they
        arrive. So time to first token and to the result are unchanged, and
        a stream costs at most one message per ``interval_s`` (Ray Serve LLM
        batches its streams the same way, every 50 ms by default). Never
        yields an empty list; a failure is raised after the items before it.
        """
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s!r}")
        sink = self._submit(prompt_token_ids, params, salt, request_id, wants_tokens=True)
        loop, queue, finished = sink.loop, sink.queue, False
        try:
            next_s = 0.0  # the first token goes out at once
            while True:
                chunk = [await queue.get()]
                wait_s = next_s - loop.time()
                if wait_s > 0 and not sink.ended.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sink.ended.wait(), wait_s)
                while not queue.empty():
                    chunk.append(queue.get_nowait())
                last = chunk[-1]
                if isinstance(last, BaseException):
                    finished = True
                    if len(chunk) > 1:
                        yield chunk[:-1]
                    raise last
                finished = isinstance(last, GenerationResult)
                yield chunk
                if finished:
                    return
                next_s = loop.time() + interval_s
        finally:
            if not finished:
                self._cancel(sink)
            self._forget(sink)

    def _submit(self, prompt_token_ids, params, salt, request_id, *, wants_tokens: bool) -> RequestSink:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        params = params if params is not None else SamplingParams()
        self.engine.validate(prompt_token_ids, params)  # the engine side's one check; the thread queues without another
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"salt must be a str or None, got {type(salt).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str or None, got {type(request_id).__name__}")
        request_id = request_id or uuid.uuid4().hex
        sink = RequestSink(request_id, asyncio.get_running_loop(), wants_tokens)
        with self._sinks_lock:
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in flight")
            num_queued = len(self._sinks) - self._snapshot["num_running"]
            if num_queued >= self.config.max_queued_requests:
                raise EngineOverloaded(f"{num_queued} requests are queued (max_queued_requests)")
            self._sinks[request_id] = sink
        self._inbox.append(("add", request_id, list(prompt_token_ids), params, salt, self._clock()))
        self._wakeup.set()
        return sink

    def _forget(self, sink: RequestSink) -> None:
        with self._sinks_lock:
            if self._sinks.get(sink.request_id) is sink:
                del self._sinks[sink.request_id]

    # ------------------------------------------------------------ inspection
    @property
    def stats(self) -> dict:
        """Engine counters as of the last step (never blocks on a running step), with
        the measured token prices (:meth:`token_costs`: ``decode_token_cost``,
        ``queue_token_cost``; 0.0 until measured)."""
        stats = dict(self._snapshot)
        stats["decode_token_cost"], stats["queue_token_cost"] = self.token_costs()
        return stats

    def load(self) -> dict:
        snapshot = self._snapshot
        with self._sinks_lock:
            num_live = len(self._sinks)
        return {
            "num_running": snapshot["num_running"],
            "num_waiting": max(snapshot["num_waiting"], num_live - snapshot["num_running"]),
            "queued_tokens": snapshot["queued_tokens"],
            "running_tokens": snapshot["running_tokens"],
            "kv_blocks_free": snapshot["kv_blocks_free"],
        }

    @contextlib.contextmanager
    def locked(self) -> Iterator[Engine]:
        """Exclusive access to the engine between steps (blocks up to one step)."""
        with self._exclusive():
            yield self.engine

    def export_prefix(self, token_ids: Sequence[int], salt: str | None = None, *, max_tokens: int | None = None,
                      timing: dict | None = None):
        """:meth:`Engine.export_prefix`: the rows copied under the cache lock
        (between steps or during a forward; one bounded copy), the checksum
        computed after. ``timing`` (optional) gets the seconds spent waiting
        for the cache (``wait_s``), copying (``copy_s``) and checksumming (``bundle_s``)."""
        start = time.perf_counter()
        with self._cache_lock:
            locked = time.perf_counter()
            copied = self.engine.copy_prefix_rows(token_ids, salt, max_tokens=max_tokens)
        copied_at = time.perf_counter()
        bundle = None if copied is None else self.engine.bundle_rows(*copied, salt)
        if timing is not None:
            timing.update(wait_s=locked - start, copy_s=copied_at - locked, bundle_s=time.perf_counter() - copied_at)
        return bundle

    @property
    def prefill_s_per_token(self) -> float | None:
        """Measured marginal seconds per prefilled token (:class:`worker.fetch_estimates.PrefillRate`; None before the first prefill step)."""
        return self._prefill_rate.s_per_token

    def token_costs(self) -> tuple[float, float]:
        """``(decode_token_cost, queue_token_cost)``: an output token in prefill-token
        equivalents as this engine's steps measure it (:class:`worker.step_costs.StepCosts`;
        ``(0.0, 0.0)`` until enough steps of both kinds were timed)."""
        return self._step_costs.prices()

    def cached_prefix_tokens(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Leading positions of ``token_ids`` cached under ``salt`` (a pure read, under the cache lock)."""
        with self._cache_lock:
            return self.engine.cache.match(token_ids, salt, touch=False).num_tokens

    def in_flight_prefix_tokens(self, token_ids: Sequence[int], salt: str | None = None, *,
                                max_tokens: int | None = None) -> int:
        """:meth:`Engine.in_flight_prefix_tokens` (how much more of the prefix a
        sequence here is still computing), under the cache lock alone. That
        suffices: the engine thread changes the scheduler's lists and a
        sequence's progress (submissions, aborts, ``schedule``, ``complete``)
        only while it holds both locks, and during a forward, when it holds
        ``_lock`` alone, it changes neither. So, like :meth:`cached_prefix_tokens`,
        this sees a consistent state between two steps or during a forward
        and never waits for a step in flight (``_lock`` would: seconds on a
        busy replica). A submission still in the inbox (a request handed in
        during a forward becomes a sequence when the next step begins) counts
        too: the copy of the inbox is one C-level pass under the GIL, and the
        engine thread drains it only under both locks."""
        with self._cache_lock:
            submitted = [command[2] for command in tuple(self._inbox) if command[0] == "add" and command[4] == salt]
            return self.engine.in_flight_prefix_tokens(token_ids, salt, max_tokens=max_tokens, submitted=submitted)

    def import_prefix(self, bundle, *, timing: dict | None = None) -> int:
        """:meth:`Engine.import_prefix`: checked (checksum included) outside any
        lock, then reserved, written and cached under the cache lock (between
        steps or during a forward: the blocks it takes are free or evicted
        ones no running sequence holds). ``timing`` (optional) gets
        ``check_s``, ``wait_s`` (for the cache lock) and ``copy_s``."""
        start = time.perf_counter()
        self.engine.check_bundle(bundle)
        checked = time.perf_counter()
        with self._cache_lock:
            locked = time.perf_counter()
            num_new = self.engine.import_checked(bundle)
        if timing is not None:
            timing.update(check_s=checked - start, wait_s=locked - checked, copy_s=time.perf_counter() - locked)
        return num_new

    def cache_block_hashes(self, block_size: int) -> set[int]:
        """Chained hashes of every full ``block_size`` block the cache holds, taken between steps."""
        with self._exclusive():
            return cached_block_hashes(self.engine.cache, block_size)

    def cache_summary(self, block_size: int, *, replica_id: str, version: int, timestamp_s: float) -> CacheSummary:
        """What the router needs from this replica (cache contents + load), taken between
        steps. Blocks the caller for at most one engine step; cost O(cached tokens)."""
        with self._sinks_lock:
            num_live = len(self._sinks)
        decode_token_cost, queue_token_cost = self.token_costs()  # a fit: outside the engine's locks
        with self._exclusive():
            scheduler = self.engine.scheduler
            return CacheSummary.from_radix(
                self.engine.cache,
                block_size,
                replica_id=replica_id,
                version=version,
                timestamp_s=timestamp_s,
                num_queued_tokens=scheduler.queued_tokens(),
                num_running_tokens=scheduler.running_tokens(),
                num_running=scheduler.num_running,
                num_waiting=max(scheduler.num_waiting, num_live - scheduler.num_running),
                mean_output_tokens=self.mean_output_tokens(),
                output_quantiles=output_quantiles(list(self._output_lengths)),
                num_prefill_tokens_total=self.engine.stats["prefill_tokens"],
                num_output_tokens_total=self._num_output_tokens_total,
                busy_s_total=round(self._busy_s_total, 3),
                num_prefilling_tokens=scheduler.prefilling_tokens(),
                decode_token_cost=decode_token_cost,
                queue_token_cost=queue_token_cost,
            )

    def mean_output_tokens(self) -> float:
        """Mean output length of the last ``OUTPUT_WINDOW`` finished requests; 0.0 when none."""
        lengths = list(self._output_lengths)
        return sum(lengths) / len(lengths) if lengths else 0.0

    def check_invariants(self) -> None:
        with self._exclusive():
            self.engine.check_invariants()
            with self._sinks_lock:
                live = {s.request_id for s in self._sinks.values()}
            aborting = {command[1] for command in list(self._inbox) if command[0] == "abort"}
            held = {seq.request_id for seq in (*self.engine.scheduler.running, *self.engine.scheduler.waiting)}
            assert held <= live | aborting, f"requests without a waiter: {held - live - aborting}"

    def check_health(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        if self._step_failed:
            raise RuntimeError("the engine's last step failed")

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the inbox is drained and no request is waiting or running."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._exclusive():
                if not self._inbox and not self.engine.has_work():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine still busy after {timeout_s} s")
            await asyncio.sleep(0.005)

    async def shutdown(self) -> None:
        """Stop the thread; requests still in flight fail with RuntimeError."""
        if self._closed:
            return
        self._closed = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)
