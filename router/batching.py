"""Simulated continuous-batching replicas: steps under a token budget, a KV
capacity, and a step time fitted to an engine (:class:`StepProfile`)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from cache import RadixCache
from cache.radix_node import common_prefix_len
from cache.summary import CacheSummary
from router.cluster import Completion, Outcome, OutputWindow, observed_summary
from router.sim_fetch import (FetchCounts, FetchPlan, SimFetch, awaits_owner_prefill, held_elsewhere, owner_computes,
                              plan_fetch, still_computed)
from router.step_profile import H100_LLAMA_8B, StepProfile
from router.workload import SimRequest

__all__ = ["H100_LLAMA_8B", "BatchingReplica", "StepProfile"]  # the profile lives in router.step_profile

OWNER_POLL_S = 0.005  # an idle replica whose waiting sequences all wait for their owners looks again this often
ADMISSION_WINDOW = 64  # waiting sequences an admission looks at past deferred ones (the engine: 2 x max_num_seqs)


@dataclass(slots=True, eq=False)
class _Seq:
    number: int
    request: SimRequest
    arrival_s: float
    num_cached: int = 0
    num_prefilled: int = 0  # prompt positions in KV (cached ones included), its latest step's chunk counted
    num_prefilled_before: int = 0  # ... before that step, which ends at step_end_s
    step_end_s: float = 0.0
    num_generated: int = 0
    fetch: SimFetch | None = None  # the hint, until the admission that plans it
    num_fetched: int = 0  # prompt tokens fetched from the owner
    ready_s: float = 0.0  # when the fetched KV has arrived; no prefill chunk before
    awaited_owner: bool = False  # deferred while its fetch's owner computed the prefix
    held_elsewhere_tokens: int = 0  # set at the first admission (report only)
    num_admissions: int = 0  # more than one: preempted and re-admitted

    @property
    def is_prefilled(self) -> bool:
        return self.num_prefilled >= self.request.num_prompt_tokens

    @property
    def num_kv_tokens(self) -> int:
        """KV positions reserved: the whole prompt from admission, plus the output."""
        return self.request.num_prompt_tokens + self.num_generated

    @property
    def num_context_tokens(self) -> int:
        return self.num_prefilled + self.num_generated


class BatchingReplica:
    """One continuous-batching worker (same surface as :class:`router.cluster.SimReplica`).

    Each step, under ``max_batch_tokens``: every running sequence that has
    its first token decodes one more; the rest of the budget goes to prefill
    chunks, first-come first-served (the running prefills first, then
    waiting requests admitted in arrival order while their prompt fits the
    KV capacity). A request's prefix is matched and its prompt inserted into
    the radix tree when it is admitted; one that shares a prefix a running
    sequence is still computing is admitted once it is computed, then shares
    it (the engine defers it: ``Scheduler._should_wait``), and the ones
    behind it are admitted meanwhile; prompt + output is inserted when it
    finishes. A prefill finishing in a step yields the first
    token at the step's end (TTFT); a sequence with all its output tokens
    finishes. When decodes need KV the capacity lacks, the newest admitted
    sequence is preempted (back to the head of the queue, recomputed).
    Steps with decodes only are taken in closed form up to the next finish
    or arrival.

    Fetch: a hinted request whose owner still computes the prefix waits
    (deferred, as one sharing a local prefix in the works) until the owner
    has computed it or the receiver's patience runs out
    (:func:`router.sim_fetch.awaits_owner_prefill`; the live owner's export
    waits so, ``ExportRequest.wait_s``). It is planned when first admitted, against the
    owner's cache then (:func:`router.sim_fetch.plan_fetch`); a fetch counts
    its tokens as prefilled but gives the sequence no prefill chunk until the
    transfer has arrived (other sequences' steps go on; with nothing else to
    run the replica waits, idle). An export delays the owner's next step by
    its copy time (counted busy).

    Invariants: ``kv_used == sum(num_kv_tokens of running)`` ≤ capacity
    (bar a single sequence larger than it); waiting holds no admitted sequence.
    """

    def __init__(self, replica_id: str, budget_units: int, profile: StepProfile,
                 protected_share: float = 0.0) -> None:
        self.replica_id = replica_id
        self.radix = RadixCache(budget_units, block_size=1, protected_share=protected_share)
        self.profile = profile
        self.reported_token_costs: tuple[float, float] | None = None  # None: the profile's
        self.reported_fetch_costs: tuple[float, float] = (0.0, 0.0)  # what a fetch costs here (FetchModel)
        self.busy_s = 0.0
        self.busy_reported = 0.0  # the busy counter last reported (observed_summary): it never goes back
        self._last_busy = (0.0, 0.0)  # (start, end) of the latest busy run counted in busy_s
        self.outcomes: dict[int, Outcome] = {}
        self._clock_s = 0.0  # when the next step may start
        self._running: list[_Seq] = []
        self._just_finished: list[_Seq] = []  # finished in the latest step (computed_units reads its end)
        self._waiting: deque[_Seq] = deque()
        self._kv_used = 0
        self._finished: list[Completion] = []  # finished in committed steps, not yet released
        self._outputs = OutputWindow()
        self.num_steps = 0
        self.num_preemptions = 0
        self._prefill_total = self._output_total = 0  # tokens prefilled / of finished requests
        self.fetch_counts = FetchCounts()
        self._awaiting_owner = False  # the latest admission passed over a sequence waiting for its owner's prefill
        self.peers: tuple[BatchingReplica, ...] = ()  # the other replicas, for the report's held-elsewhere figure

    def match_units(self, units: tuple[int, ...]) -> int:
        return self.radix.match(units, touch=False).num_tokens

    def queued_units(self, units: tuple[int, ...]) -> int:
        """:meth:`router.sim_fetch.Owner.queued_units`: the longest prefix of
        ``units`` a waiting sequence's prompt shares (a sequence enters the
        tree when admitted). O(waiting × shared units), in C mostly."""
        return max((common_prefix_len(seq.request.units, units, 0) for seq in self._waiting), default=0)

    def computed_units(self, units: tuple[int, ...], now: float) -> int:
        """:meth:`match_units` less what a running sequence's prefill has
        yet to compute at ``now`` (inserted at admission, computed chunk by
        chunk; a step's chunks once it ends): what an export reads."""
        held = self.match_units(units)
        for seq in (*self._running, *self._just_finished):
            if seq.step_end_s <= now and seq.is_prefilled:
                continue
            done = (seq.num_prefilled if seq.step_end_s <= now else seq.num_prefilled_before) // seq.request.unit_tokens
            if held > done and still_computed(units, seq.request.units, done):
                held = done
        return held

    def prefill_done_s(self, units: tuple[int, ...], num_units: int, now: float) -> float:
        """:meth:`router.sim_fetch.Owner.prefill_done_s`: ``now`` once computed,
        else ``inf`` (a step's length is not known ahead: a receiver defers
        instead, :func:`router.sim_fetch.awaits_owner_prefill`)."""
        return now if self.computed_units(units, now) >= num_units else math.inf

    def busy_until(self, now: float) -> float:
        """Seconds this replica was busy up to ``now``: ``busy_s`` less the
        part of its latest busy run (steps or an export, counted whole when
        they start) that lies past ``now``. Busy runs start in clock order,
        so no earlier one reaches past the latest's start."""
        start, end = self._last_busy
        return self.busy_s - max(0.0, end - max(now, start))

    def _count_busy(self, start: float, busy_s: float) -> None:
        self.busy_s += busy_s
        self._last_busy = (start, start + busy_s)

    def export(self, units: tuple[int, ...], now: float, busy_s: float) -> None:
        # the worker's export reads the tree without an LRU touch (KVCache.pinned_prefix): nothing to do here
        if not self._running and not self._waiting:
            self._clock_s = max(self._clock_s, now)
        self._count_busy(self._clock_s, busy_s)
        self._clock_s += busy_s
        self.fetch_counts.export_busy_s += busy_s

    def submit(self, number: int, request: SimRequest, now: float, fetch: SimFetch | None = None) -> None:
        if not self._running and not self._waiting:
            self._clock_s = max(self._clock_s, now)
        self._waiting.append(_Seq(number, request, now, fetch=fetch))

    def advance(self, until: float) -> list[Completion]:
        """Run every step that starts before ``until``; release the finishes up to it."""
        while (self._running or self._waiting) and self._clock_s < until:
            self._step(until)
        if not self._running and not self._waiting:
            self._clock_s = max(self._clock_s, until) if math.isfinite(until) else self._clock_s
        done = [c for c in self._finished if c.finish_s <= until]
        self._finished = [c for c in self._finished if c.finish_s > until]
        return done

    # ----------------------------------------------------------------- steps
    def _step(self, until: float) -> None:
        profile = self.profile
        decoding = [s for s in self._running if s.is_prefilled]
        if len(decoding) == len(self._running) and self._next_admissible() is None:
            if decoding:  # one step at a time while a sequence waits for its owner: it may come in at any
                self._decode_steps(decoding, until, max_steps=1 if self._awaiting_owner else None)
            else:  # only sequences waiting for their owners' prefill: look again a poll later
                self._clock_s = min(self._clock_s + OWNER_POLL_S, until)
            return
        self._make_room(len(decoding))
        decoding = [s for s in self._running if s.is_prefilled]
        budget = profile.max_batch_tokens - len(decoding)
        context = sum(s.num_context_tokens for s in decoding)
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._running:
            if budget <= 0:
                break
            if not seq.is_prefilled and seq.ready_s <= self._clock_s:
                chunk = min(budget, seq.request.num_prompt_tokens - seq.num_prefilled)
                chunks.append((seq, chunk))
                budget -= chunk
        while budget > 0 and (seq := self._next_admissible()) is not None:
            self._admit(seq)
            chunk = min(budget, seq.request.num_prompt_tokens - seq.num_prefilled)
            if chunk > 0 and seq.ready_s <= self._clock_s:
                chunks.append((seq, chunk))
                budget -= chunk
        if not chunks and not decoding:  # only fetches in flight: wait for the first, idle
            first_ready = min(s.ready_s for s in self._running)
            self._clock_s = min(first_ready, until) if math.isfinite(until) else first_ready
            return
        num_prefill = 0
        for seq, chunk in chunks:
            num_prefill += chunk
            self._prefill_total += chunk
            context += seq.num_prefilled + chunk
        step_s = profile.step_s(num_prefill, len(decoding), context)
        end_s = self._clock_s + step_s
        self._count_busy(self._clock_s, step_s)
        self.num_steps += 1
        self._clock_s = end_s
        for seq in decoding:
            seq.num_generated += 1
            self._kv_used += 1
        for seq, chunk in chunks:
            seq.num_prefilled_before, seq.step_end_s = seq.num_prefilled, end_s
            seq.num_prefilled += chunk
            if seq.is_prefilled:  # first token
                seq.num_generated = 1
                self._kv_used += 1
                self.outcomes.setdefault(seq.number, Outcome(seq.num_cached, end_s - seq.arrival_s, seq.num_fetched,
                                                             seq.held_elsewhere_tokens))
        self._finish_done(end_s)

    def _decode_steps(self, decoding: list[_Seq], until: float, max_steps: int | None = None) -> None:
        """Decode-only steps in closed form: up to the next finish, the KV
        limit, ``max_steps`` and the last step starting before ``until``."""
        profile, n = self.profile, len(decoding)
        k = min(s.request.num_output_tokens - s.num_generated for s in decoding)
        k = k if max_steps is None else min(k, max_steps)
        room = (profile.kv_capacity_tokens - self._kv_used) // n
        if room < 1 and len(self._running) > 1:
            self._make_room(n)
            return
        k = min(k, room) if room >= 1 else k  # a lone sequence larger than the capacity runs anyway
        per_step = profile.base_s + profile.decode_seq_s * n
        context0 = sum(s.num_context_tokens for s in decoding)

        def elapsed(j: int) -> float:  # time of j steps
            return j * per_step + profile.context_token_s * (j * context0 + n * j * (j - 1) // 2)

        if math.isfinite(until) and self._clock_s + elapsed(k - 1) >= until:
            low, high = 1, k  # steps 1..low start before until
            while high - low > 1:
                mid = (low + high) // 2
                if self._clock_s + elapsed(mid - 1) < until:
                    low = mid
                else:
                    high = mid
            k = low
        step_s = elapsed(k)
        self._count_busy(self._clock_s, step_s)
        self._clock_s += step_s
        self.num_steps += k
        for seq in decoding:
            seq.num_generated += k
        self._kv_used += n * k
        self._finish_done(self._clock_s)

    def _finish_done(self, end_s: float) -> None:
        still, self._just_finished = [], []
        for seq in self._running:
            if seq.num_generated >= seq.request.num_output_tokens and seq.is_prefilled:
                self._kv_used -= seq.num_kv_tokens
                self.radix.insert(seq.request.cache_units)
                self._outputs.add(seq.request.num_output_tokens)
                self._output_total += seq.request.num_output_tokens
                self._finished.append(Completion(seq.number, end_s))
                self._just_finished.append(seq)
            else:
                still.append(seq)
        self._running = still

    def _next_admissible(self) -> _Seq | None:
        """The first waiting sequence (of the first ``ADMISSION_WINDOW``) that
        shares no prefix a running sequence is still computing, if its prompt
        fits the KV capacity (or nothing runs); else None. The engine defers
        such a sequence until the prefix is computed, then reuses it
        (``Scheduler._should_wait``), and admits the ones behind it meanwhile."""
        now = self._clock_s
        self._awaiting_owner = False
        computing = bool(self._running) and any(
            s.step_end_s > now or not s.is_prefilled for s in (*self._running, *self._just_finished))
        for index, seq in enumerate(self._waiting):
            if index >= ADMISSION_WINDOW:
                return None
            units = seq.request.units
            if computing and self.computed_units(units, now) < self.match_units(units):
                continue
            if seq.fetch is not None and self._awaits_owner(seq, now):
                self._awaiting_owner = seq.awaited_owner = True
                continue
            fits = self._kv_used + seq.request.num_prompt_tokens <= self.profile.kv_capacity_tokens
            return seq if fits or not self._running else None
        return None

    def _plan_fetch(self, seq: _Seq, num_units: int) -> FetchPlan:
        """:func:`plan_fetch` at admission; a sequence admitted while its
        owner still computes the prefix waited its patience out
        (``"outwaited"``: it recomputes); one that waited for it and fetches
        has that wait in ``wait_s`` (for the counts: the deferral took it)."""
        request, now = seq.request, self._clock_s
        if seq.awaited_owner and owner_computes(seq.fetch, request.units, request.unit_tokens, num_units, now):
            return FetchPlan(0, 0, 0.0, "outwaited", 1)
        plan = plan_fetch(seq.fetch, request.units, request.unit_tokens, num_units, request.cached_tokens,
                          self.profile, now)
        return replace(plan, wait_s=now - seq.arrival_s) if seq.awaited_owner and plan.num_units else plan

    def _awaits_owner(self, seq: _Seq, now: float) -> bool:
        request = seq.request
        return awaits_owner_prefill(seq.fetch, request.units, request.unit_tokens, self.match_units(request.units),
                                    request.cached_tokens, self.profile, seq.arrival_s, now)

    def _admit(self, seq: _Seq) -> None:
        if self._waiting[0] is seq:
            self._waiting.popleft()
        else:
            self._waiting.remove(seq)
        request = seq.request
        seq.num_admissions += 1
        is_first_admission = seq.num_admissions == 1
        # a re-admission finds what it cached itself: a pure read, not a reuse the segmented LRU protects
        num_units = self.radix.match(request.units, touch=is_first_admission).num_tokens
        seq.num_cached = request.cached_tokens(num_units)
        if seq.fetch is not None:
            plan = self._plan_fetch(seq, num_units)
            seq.fetch = None  # planned once: a preempted sequence finds the fetched prefix in its own tree
            self.fetch_counts.count(plan)
            if plan.num_units:
                seq.num_cached = request.cached_tokens(plan.num_units)
                seq.num_fetched = plan.num_tokens
            if plan.transfer_s:  # a fetch, or the round trips that found the prefix evicted
                seq.ready_s = self._clock_s + plan.transfer_s
        if is_first_admission:
            seq.held_elsewhere_tokens = held_elsewhere(self.peers, request.units, request.cached_tokens,
                                                       seq.num_cached, self._clock_s)
        seq.num_prefilled = seq.num_prefilled_before = seq.num_cached
        seq.num_generated = 0
        self._kv_used += request.num_prompt_tokens  # the whole prompt's KV is reserved at admission
        self.radix.insert(request.units)
        self._running.append(seq)

    def _make_room(self, num_decoding: int) -> None:
        """Preempt the newest sequences until the decodes' next tokens fit."""
        while self._running and self._kv_used + num_decoding > self.profile.kv_capacity_tokens \
                and len(self._running) > 1:
            seq = self._running.pop()
            self._kv_used -= seq.num_kv_tokens
            num_decoding -= seq.is_prefilled
            seq.num_prefilled = seq.num_generated = 0
            self._waiting.appendleft(seq)  # re-admitted first, recomputed (it may hit its own prefix)
            self.num_preemptions += 1

    # ---------------------------------------------------------- observation
    def queue_len(self, now: float) -> int:
        return len(self._running) + len(self._waiting)

    def active_tokens(self, now: float) -> int:
        return sum(s.request.num_prompt_tokens for s in self._waiting) + self._running_tokens()

    def _running_tokens(self) -> int:
        return sum(s.request.num_prompt_tokens + s.num_generated for s in self._running)

    @property
    def token_costs(self) -> tuple[float, float]:
        """What a live worker measures of its own steps: (busy, queue) prefill-token price of an output
        token — its timing's, or ``reported_token_costs`` where given (a live run's Workers' reports)."""
        if self.reported_token_costs is not None:
            return self.reported_token_costs
        return self.profile.decode_token_cost, self.profile.queue_token_cost

    def summary(self, version: int, now: float, unit_tokens: int, units_per_block: int) -> CacheSummary:
        return observed_summary(
            self, version, now, unit_tokens, units_per_block, num_waiting=len(self._waiting),
            num_running=len(self._running), queued=sum(s.request.num_prompt_tokens for s in self._waiting),
            running=self._running_tokens(),
            prefilling=sum(s.request.num_prompt_tokens - s.num_prefilled for s in self._running if not s.is_prefilled),
        )

    def check_invariants(self) -> None:
        assert self._kv_used == sum(s.num_kv_tokens for s in self._running), "kv_used drifted"
        assert not any(s in self._running for s in self._waiting)
        assert all(s.num_generated <= s.request.num_output_tokens for s in self._running)
