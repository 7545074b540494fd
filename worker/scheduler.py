"""Continuous batching over the KV cache (cache/kv_cache.py).

The scheduler decides who runs and how much; :class:`cache.KVCache` does
every block and tree operation (matching, locking, eviction, copy-on-write,
caching) and answers ``None`` when the pool cannot make room. Each step
(:meth:`Scheduler.schedule`) fills a budget of ``max_batch_tokens`` tokens:

1. Running sequences, oldest admission first: a decoding one feeds its last
   sampled token (one new slot, ``kv.append``, which copies a shared last
   block first); a prefilling one feeds its next chunk. When the pool is out
   of blocks even after the KV cache evicted what it could: preempt the
   youngest running sequence (``kv.release``, requeued at the front; its
   tokens are recomputed later, mostly from the cache), possibly the one
   asking.
2. Waiting sequences, oldest first, while budget and ``max_num_seqs`` allow:
   ``kv.admit`` reuses the longest cached prefix of ``tokens[:-1]`` (so the
   last position's logits are computed) and reserves the rest of the
   prompt; feed a first chunk. A sequence that does not fit stops admission
   for this step. *In-flight sharing*: a sequence that shares a prefix of at
   least one block with a sequence still prefilling (same salt), longer than
   what the cache holds, waits until that prefill is cached, so a common
   prefix is computed once (a chance match shorter than a block never holds
   anyone). :meth:`Scheduler.in_flight_prefix_tokens` applies the same rule
   for an owner's export that may wait for such a prefix (worker/kv_fetch.py).

After the forward, :meth:`complete` advances each sequence: a prefilling
one caches its newly completed full blocks (the whole prompt when its
prefill ends, ``kv.cache``); a sequence whose chunk reached its last token
takes the sampled token, and on EOS / stop token / ``max_new_tokens`` it
finishes: ``kv.finish`` caches every token with KV (prompt + output but the
last) and releases it.

Invariants (checked by :meth:`check_invariants`): running sequences are
exactly the KV cache's sequences; a running sequence's reserved positions
are ``len(token_ids)`` (or one less, between sampling and its next decode)
and its cached positions are at most its computed ones; waiting sequences
hold nothing; plus the KV cache's own invariants.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cache.kv_cache import KVCache
from worker.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start_pos: int
    num_tokens: int

    @property
    def needs_logits(self) -> bool:
        return self.start_pos + self.num_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class ScheduledStep:
    chunks: list[ScheduledChunk]
    copies: list[tuple[int, int]]  # (src, dst) KV block copies to do before the forward


@dataclass(slots=True)
class SchedulerCounters:
    hits: int = 0  # first admissions that reused >= 1 cached token
    misses: int = 0
    tokens_saved: int = 0  # prompt tokens reused at first admission (= sum of cached_tokens)
    readmission_tokens_saved: int = 0  # tokens reused when re-admitting preempted sequences
    prefill_tokens: int = 0  # tokens run through the model in prefill (recomputation included)
    decode_tokens: int = 0
    preemptions: int = 0
    inflight_holds: int = 0  # admissions deferred to share a prefix being computed
    cow_copies: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        *,
        max_batch_tokens: int,
        max_num_seqs: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()

    @property
    def watermark_blocks(self) -> int:
        """Free blocks an admission leaves for running sequences' appends."""
        return self.kv.watermark_blocks

    # ----------------------------------------------------------------- queries
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.waiting)

    def prefilling_tokens(self) -> int:
        """Prompt tokens the running sequences' chunked prefill has still to compute."""
        return sum(seq.prefill_target - seq.num_computed for seq in self.running if seq.is_prefilling)

    def running_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.running)

    # ---------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.refresh_key()
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; its blocks and locks are released."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return self._mark_aborted(seq)
        for seq in self.running:
            if seq.request_id == request_id:
                self.kv.release(seq.request_id)
                self.running.remove(seq)
                return self._mark_aborted(seq)
        return None

    # -------------------------------------------------------------- scheduling
    def schedule(self, now_s: float | None = None) -> ScheduledStep | None:
        budget = self.max_batch_tokens
        step = ScheduledStep([], [])
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.is_prefilling:
                num = min(seq.prefill_target - seq.num_computed, budget)
            else:
                if not self._reserve_decode_slot(seq, step):
                    preempted = True
                    continue  # seq itself was preempted; running[index] is now the next one
                num = 1
            step.chunks.append(ScheduledChunk(seq, seq.num_computed, num))
            budget -= num
            index += 1
        if not preempted:  # a pool that just forced preemption admits nobody this step
            self._admit(step, budget, now_s)
        if not step.chunks:
            return None
        self.counters.steps += 1
        return step

    def _reserve_decode_slot(self, seq: Sequence, step: ScheduledStep) -> bool:
        """Reserve position ``len(token_ids) - 1``; False if ``seq`` had to be preempted."""
        if self.kv.num_reserved_tokens(seq.request_id) >= len(seq.token_ids):
            return True
        while True:
            reserved = self.kv.append(seq.request_id)
            if reserved is not None:
                self._copy(step, reserved.copy)
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False

    def _admit(self, step: ScheduledStep, budget: int, now_s: float | None) -> None:
        admitted: list[Sequence] = []
        num_considered = 0
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs or num_considered >= 2 * self.max_num_seqs:
                break
            num_considered += 1
            if self._should_wait(seq, self.kv.num_reusable_tokens(seq.token_ids, seq.salt), admitted):
                self.counters.inflight_holds += 1
                continue
            reserved = self.kv.admit(seq.request_id, seq.token_ids, seq.salt,
                                     is_readmission=seq.cached_tokens is not None)
            if reserved is None:
                break
            self._copy(step, reserved.copy)
            self.waiting.remove(seq)
            self._start(seq, reserved.num_cached_tokens)
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now_s
            num = min(len(seq.token_ids) - seq.num_computed, budget)
            step.chunks.append(ScheduledChunk(seq, seq.num_computed, num))
            budget -= num
            admitted.append(seq)

    def _copy(self, step: ScheduledStep, copy: tuple[int, int] | None) -> None:
        if copy is not None:
            step.copies.append(copy)
            self.counters.cow_copies += 1

    def _start(self, seq: Sequence, num_reused: int) -> None:
        seq.status = Status.RUNNING
        seq.num_computed = num_reused
        seq.prefill_target = len(seq.token_ids)
        if seq.cached_tokens is None:
            seq.cached_tokens = num_reused
            self.counters.hits += num_reused > 0
            self.counters.misses += num_reused == 0
            self.counters.tokens_saved += num_reused
        else:
            self.counters.readmission_tokens_saved += num_reused
        self.running.append(seq)

    def _should_wait(self, seq: Sequence, num_cached: int, admitted: list[Sequence]) -> bool:
        """True if a sequence still prefilling shares a real prefix with ``seq`` (at least
        one block) and will cache more of it than the cache holds now."""
        limit = len(seq.token_ids) - 1
        if limit <= num_cached:
            return False
        for other in (*self.running, *admitted):
            if not other.is_prefilling or other.salt != seq.salt:
                continue
            common = _num_common_tokens(seq.key, other.key, min(limit, other.prefill_target))
            if self._is_shared_prefix(common, num_cached):
                return True
        return False

    def _is_shared_prefix(self, num_common: int, num_cached: int) -> bool:
        """In-flight sharing's rule: a real prefix (at least one block, so a chance match never
        counts) that is longer than what the cache holds."""
        return num_common >= self.block_size and num_common > num_cached

    def in_flight_prefix_tokens(self, key: np.ndarray, salt: str | None, num_cached: int,
                                submitted: Iterable[np.ndarray] = ()) -> int:
        """The longest prefix of ``key`` (token ids) that a sequence under ``salt``
        will compute and cache (running and still prefilling, or waiting to be
        admitted, preempted ones included; or one of ``submitted``, prompts
        under ``salt`` not queued here yet), when it is a shared prefix by
        :meth:`_should_wait`'s rule (at least one block, more than the
        ``num_cached`` the cache holds); else 0. A pure read; O(sequences x len(key))."""
        computing = [(seq.key, seq.prefill_target) for seq in self.running if seq.is_prefilling and seq.salt == salt]
        computing += [(seq.key, len(seq.key)) for seq in self.waiting if seq.salt == salt]  # admission computes it all
        computing += [(prompt, len(prompt)) for prompt in submitted]
        longest = max((_num_common_tokens(key, other, num_target) for other, num_target in computing), default=0)
        return longest if self._is_shared_prefix(longest, num_cached) else 0

    def _preempt(self, seq: Sequence) -> None:
        self.kv.release(seq.request_id)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed = seq.prefill_target = 0
        seq.num_preemptions += 1
        seq.refresh_key()
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1

    def _mark_aborted(self, seq: Sequence) -> Sequence:
        seq.status = Status.FINISHED
        self.counters.aborted += 1
        return seq

    # --------------------------------------------------------------- completion
    def complete(
        self, step: ScheduledStep, tokens: list[int], logprobs: list[float], now_s: float
    ) -> list[tuple[Sequence, int, float]]:
        """Advance the step's sequences; ``tokens``/``logprobs`` hold one entry per
        chunk with ``needs_logits``, in order. Returns (seq, token, logprob) per
        sampled token; finished sequences have status FINISHED."""
        sampled = []
        index = 0
        for chunk in step.chunks:
            seq = chunk.seq
            was_prefilling = seq.is_prefilling
            seq.num_computed += chunk.num_tokens
            if was_prefilling:
                self.counters.prefill_tokens += chunk.num_tokens
                self._insert(seq, seq.num_computed if not seq.is_prefilling else self._full_blocks(seq.num_computed))
            else:
                self.counters.decode_tokens += chunk.num_tokens
            if not chunk.needs_logits:
                continue
            token, logprob = tokens[index], logprobs[index]
            index += 1
            seq.token_ids.append(token)
            seq.output_logprobs.append(logprob)
            if seq.first_token_s is None:
                seq.first_token_s = now_s
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                seq.finished_s = now_s
            sampled.append((seq, token, logprob))
        assert index == len(tokens), (index, len(tokens))
        return sampled

    def _full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size * self.block_size

    def _insert(self, seq: Sequence, num_tokens: int) -> None:
        """Cache ``token_ids[:num_tokens]`` (all with KV); the KV cache moves the lock."""
        self.kv.cache(seq.request_id, seq.token_ids[:num_tokens])

    def _finish_reason(self, seq: Sequence, token: int):
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output >= params.max_new_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.kv.finish(seq.request_id, seq.token_ids[: seq.num_computed])  # prompt + output but the last token
        self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.counters.finished += 1

    # --------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        running_ids = {seq.request_id for seq in self.running}
        assert len(running_ids) == len(self.running), "a request runs twice"
        assert set(self.kv.seq_ids()) == running_ids, (set(self.kv.seq_ids()), running_ids)
        for seq in self.running:
            assert seq.status is Status.RUNNING
            reserved = self.kv.num_reserved_tokens(seq.request_id)
            assert reserved in (len(seq.token_ids), len(seq.token_ids) - 1), (seq.request_id, reserved)
            assert self.kv.num_cached_tokens(seq.request_id) <= seq.num_computed <= len(seq.token_ids)
        for seq in self.waiting:
            assert seq.status is Status.WAITING and seq.request_id not in self.kv
        self.kv.check_invariants()


def _num_common_tokens(key: np.ndarray, other_key: np.ndarray, span: int) -> int:
    """Leading positions, at most ``span``, where ``key`` and ``other_key`` hold the same token."""
    span = min(span, len(key), len(other_key))
    if span <= 0 or key[0] != other_key[0]:  # the common case, without the vector compare
        return 0
    differs = np.flatnonzero(key[:span] != other_key[:span])
    return int(differs[0]) if len(differs) else span
