"""The synchronous engine: model runner + KV pool + allocator + radix cache +
scheduler, stepped by the caller.

``Engine.step()`` runs one forward over the scheduler's batch and returns the
tokens it produced as :class:`TokenEvent` records. ``generate`` and
``generate_batch`` are the DESIGN.md contract (greedy, stop only at EOS);
worker/async_engine.py steps the same object from a background thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from cache.kv_cache import KVCache
from worker import host
from worker.config import EngineConfig
from worker.engine_stats import engine_stats
from worker.kv import bytes_per_token, pool_tokens_from_free_memory
from worker.kv_bundle import KVBundle, gather_rows, scatter_rows, weights_fingerprint
from worker.results import GenerationResult, TokenEvent
from worker.runner import ModelRunner
from worker.sampling import SamplingParams, make_generator, sample
from worker.scheduler import Scheduler
from worker.sequence import Sequence as Seq
from worker.sequence import Status
from worker.step import SeqChunk

logger = logging.getLogger(__name__)


class Engine:
    """One model replica's generation engine (not thread-safe; one caller steps it).

    Invariants (:meth:`check_invariants`): the scheduler's (running requests
    are exactly the allocator's sequences, each locks one tree path), the
    allocator's (ref counts = tables + tree retains) and the radix cache's
    (budget, locks, retained blocks).
    """

    def __init__(self, config: EngineConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config = config or EngineConfig()
        self._clock = clock
        if config.tune_malloc:
            host.tune_malloc()
        host.set_threads(config.num_threads)
        self.runner = ModelRunner.from_config(config)
        loaded = self.runner.loaded
        if config.max_model_len is not None and config.max_model_len > loaded.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context {loaded.max_position_embeddings}"
            )
        self.max_model_len = config.max_model_len or loaded.max_position_embeddings
        self.model_id = loaded.model_id
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.bytes_per_token = bytes_per_token(loaded.geometry, self.runner.dtype)
        self.weights_fingerprint = weights_fingerprint(loaded.model)  # bundles carry it; imports check it
        pool_tokens = self._pool_tokens()
        num_blocks = -(-pool_tokens // config.block_size)
        self.pool = self.runner.new_pool(num_blocks, config.block_size)
        self.kv_cache = KVCache(
            num_blocks, config.block_size, config.cache_budget_tokens, max_namespaces=config.max_cache_namespaces,
            protected_share=config.cache_protected_share,
        )
        self.allocator, self.cache = self.kv_cache.allocator, self.kv_cache.radix  # read-only views (stats, audits)
        self.scheduler = Scheduler(
            self.kv_cache, max_batch_tokens=config.max_batch_tokens,
            max_num_seqs=config.max_num_seqs, eos_token_ids=self.eos_token_ids,
        )
        self._rng = random.Random(config.seed)
        self._request_counter = itertools.count()
        self._import_counter = itertools.count()
        self.num_exported_tokens = 0  # positions exported in bundles since start
        self.num_imported_tokens = 0  # positions newly cached from imported bundles since start
        self._live: dict[str, Seq] = {}
        self.last_step_ran = False  # did the last step() run a forward?
        # Entered around each step's model forward, which touches no cache state but the rows of
        # blocks its sequences hold alone (AsyncEngine lets cache readers and importers in there).
        self.forward_window: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        logger.info(
            "engine: model=%s deterministic=%s pool=%d blocks x %d (%d bytes/token) budget=%d tokens",
            self.model_id, config.deterministic, num_blocks, config.block_size, self.bytes_per_token,
            config.cache_budget_tokens,
        )

    def _pool_tokens(self) -> int:
        config = self.config
        if config.kv_pool_tokens is not None:
            return config.kv_pool_tokens
        if self.runner.device.type == "cuda":
            tokens = pool_tokens_from_free_memory(
                self.runner.geometry, self.runner.dtype, self.runner.device, config.gpu_memory_fraction
            )
            if tokens <= config.cache_budget_tokens:
                raise ValueError(f"free GPU memory holds {tokens} KV positions, not more than the cache budget")
            return tokens
        return config.cache_budget_tokens + 8 * self.max_model_len

    # -------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the problem) if the request cannot be served."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(prompt_token_ids).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty")
        for index, token in enumerate(prompt_token_ids):
            if type(token) is not int or not 0 <= token < self.vocab_size:
                raise ValueError(f"prompt token {index} is {token!r}, not a token id in [0, {self.vocab_size})")
        for token in params.stop_token_ids:
            if token >= self.vocab_size:
                raise ValueError(f"stop token id {token} is outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt_token_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total}"
                f" exceeds max_model_len {self.max_model_len}"
            )
        needed = -(-total // self.config.block_size) + 1 + self.scheduler.watermark_blocks
        if needed > self.allocator.num_blocks:
            raise ValueError(f"request needs {needed} KV blocks, the pool has {self.allocator.num_blocks}")

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        salt: str | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
    ) -> str:
        """Validate (ValueError naming the problem) and queue; returns the request id."""
        params = params or SamplingParams()
        self.validate(prompt_token_ids, params)
        return self.add_validated(prompt_token_ids, params, salt=salt, request_id=request_id, arrival_s=arrival_s)

    def add_validated(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        salt: str | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
    ) -> str:
        """:meth:`add_request` for a request :meth:`validate` already passed
        (each prompt is checked once: by ``generate_batch`` before any is
        queued, by ``AsyncEngine`` on submit)."""
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"salt must be a str or None, got {type(salt).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        elif request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in flight")
        generator = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            generator = make_generator(seed)
        seq = Seq(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            prompt_len=len(prompt_token_ids),
            params=params,
            salt=salt,
            arrival_s=self._clock() if arrival_s is None else arrival_s,
            generator=generator,
        )
        self._live[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks and cache locks are released. False if unknown."""
        seq = self.scheduler.abort(request_id)
        self._live.pop(request_id, None)
        return seq is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenEvent]:
        """Run one forward over the scheduled batch; the tokens it produced."""
        scheduled = self.scheduler.schedule(self._clock())
        self.last_step_ran = scheduled is not None
        if scheduled is None:
            return []
        self.pool.copy_blocks(scheduled.copies)
        chunks = [
            SeqChunk(
                token_ids=c.seq.token_ids[c.start_pos : c.start_pos + c.num_tokens],
                start_pos=c.start_pos,
                block_table=self.allocator.block_table(c.seq.request_id),
                needs_logits=c.needs_logits,
            )
            for c in scheduled.chunks
        ]
        with self.forward_window():
            logits = self.runner.forward(chunks, self.pool)
        wanted = [c.seq for c in scheduled.chunks if c.needs_logits]
        tokens, logprobs = sample(logits, [s.params for s in wanted], [s.generator for s in wanted])
        sampled = self.scheduler.complete(scheduled, tokens, logprobs, self._clock())
        events = []
        for seq, token, logprob in sampled:
            result = None
            if seq.status is Status.FINISHED:
                result = seq.result()
                self._live.pop(seq.request_id, None)
            events.append(
                TokenEvent(seq.request_id, token, logprob if seq.params.logprobs else None, seq.num_output - 1, result)
            )
        return events

    def run(self, request_ids: Sequence[str]) -> dict[str, GenerationResult]:
        """Step until every listed request finished; their results (other requests' events are dropped)."""
        pending, results = set(request_ids), {}
        while pending:
            if not self.has_work():
                raise RuntimeError(f"requests {sorted(pending)} are not in the engine")
            events = self.step()
            if not self.last_step_ran:  # work left but nothing schedulable: a bug, not a wait
                raise RuntimeError(f"the scheduler made no progress with {self.scheduler.num_waiting} waiting")
            for event in events:
                if event.result is not None and event.request_id in pending:
                    results[event.request_id] = event.result
                    pending.discard(event.request_id)
        return results

    # -------------------------------------------------------------- contract
    def generate(self, prompt: Sequence[int], max_new_tokens: int, logprobs: bool = False):
        """Greedy; stops early only at EOS. ``logprobs=True`` → ``(token_ids, logprobs)``."""
        return self.generate_batch([prompt], max_new_tokens, logprobs=logprobs)[0]

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, logprobs: bool = False) -> list:
        """What :meth:`generate` returns for each prompt, in input order; all run together."""
        params = SamplingParams(max_new_tokens=max_new_tokens, logprobs=logprobs)
        for prompt in prompts:
            self.validate(prompt, params)
        ids = [self.add_validated(prompt, params) for prompt in prompts]
        results = self.run(ids)
        out = []
        for request_id in ids:
            result = results[request_id]
            tokens = list(result.token_ids)
            out.append((tokens, list(result.logprobs)) if logprobs else tokens)
        return out

    # ----------------------------------------------------------- KV transfer
    def export_prefix(
        self, token_ids: Sequence[int], salt: str | None = None, *, max_tokens: int | None = None
    ) -> KVBundle | None:
        """The KV of the longest cached prefix of ``token_ids`` under ``salt``
        (at most ``max_tokens`` positions) as one bundle; ``None`` when nothing
        of it is cached: :meth:`copy_prefix_rows` then :meth:`bundle_rows`."""
        copied = self.copy_prefix_rows(token_ids, salt, max_tokens=max_tokens)
        return None if copied is None else self.bundle_rows(*copied, salt)

    def copy_prefix_rows(
        self, token_ids: Sequence[int], salt: str | None = None, *, max_tokens: int | None = None
    ) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """The part of an export that needs the engine: ``(the cached prefix's
        token ids, a CPU copy of its rows [layers, 2, kv_heads, num_tokens,
        head_dim])``, or ``None``. A pure read of the tree (no LRU touch, no
        stats); the path is locked while its rows are copied, one copy of that
        many positions, so the engine is held for a bounded copy only."""
        self._check_prefix_query(token_ids, salt, max_tokens)
        with self.kv_cache.pinned_prefix(token_ids, salt) as match:
            num_tokens = match.num_tokens if max_tokens is None else min(match.num_tokens, max_tokens)
            if num_tokens == 0:
                return None
            rows = gather_rows(self.pool, match.block_ids, num_tokens)
        self.num_exported_tokens += num_tokens
        return tuple(token_ids[:num_tokens]), rows

    def in_flight_prefix_tokens(
        self, token_ids: Sequence[int], salt: str | None = None, *, max_tokens: int | None = None,
        submitted: Sequence[Sequence[int]] = (),
    ) -> int:
        """How long a prefix of ``token_ids`` (at most ``max_tokens``) under
        ``salt`` a sequence of this engine is still computing beyond what the
        cache holds now: running and prefilling it, or waiting to be admitted,
        or one of ``submitted`` (prompts under ``salt`` handed to the engine
        but not added yet: ``AsyncEngine``'s inbox)
        (:meth:`Scheduler.in_flight_prefix_tokens`: at least one block); 0 if
        none. An export that may wait polls it (worker/kv_fetch.py). A pure
        read of the tree and the scheduler's lists."""
        self._check_prefix_query(token_ids, salt, max_tokens)
        prefix = token_ids if max_tokens is None else token_ids[:max_tokens]
        num_cached = self.kv_cache.radix.match(prefix, salt, touch=False).num_tokens
        key = np.asarray(prefix, dtype=np.int64)
        prompts = [np.asarray(prompt, dtype=np.int64) for prompt in submitted]
        return self.scheduler.in_flight_prefix_tokens(key, salt, num_cached, prompts)

    def _check_prefix_query(self, token_ids: Sequence[int], salt: str | None, max_tokens: int | None) -> None:
        """ValueError unless ``(token_ids, salt, max_tokens)`` is a well-formed export request's."""
        self._check_tokens(token_ids, "token_ids")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"salt must be a str or None, got {type(salt).__name__}")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
            raise ValueError(f"max_tokens must be a non-negative int or None, got {max_tokens!r}")

    def bundle_rows(self, token_ids: Sequence[int], rows: torch.Tensor, salt: str | None) -> KVBundle:
        """``rows`` of ``token_ids`` as a checksummed bundle of this engine's
        model (touches no engine state: callers run it outside the engine lock)."""
        geometry = self.runner.geometry
        return KVBundle.build(
            model_id=self.model_id, num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim, block_size=self.config.block_size, weights_fingerprint=self.weights_fingerprint,
            token_ids=token_ids, salt=salt, rows=rows,
        )

    def check_bundle(self, bundle: KVBundle) -> None:
        """Raise ValueError unless ``bundle`` fits this engine: model, weights, dtype,
        geometry, token ids in the vocabulary, checksum (touches no engine
        state: callers run it outside the engine lock)."""
        if not isinstance(bundle, KVBundle):
            raise ValueError(f"bundle must be a KVBundle, got {type(bundle).__name__}")
        geometry = self.runner.geometry
        bundle.check(
            model_id=self.model_id, dtype=self.runner.dtype, num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, weights_fingerprint=self.weights_fingerprint,
        )
        self._check_tokens(bundle.token_ids, "bundle token_ids")

    def import_prefix(self, bundle: KVBundle) -> int:
        """:meth:`check_bundle` (ValueError, nothing changed), then :meth:`import_checked`."""
        self.check_bundle(bundle)
        return self.import_checked(bundle)

    def import_checked(self, bundle: KVBundle) -> int:
        """Cache a bundle :meth:`check_bundle` passed under its salt; returns
        the positions newly cached.

        Reuses what is cached already (full blocks shared, a partly cached last
        block copied first), allocates the rest (evicting unlocked entries
        least recently used first, keeping the watermark), writes the missing
        rows and inserts them into the tree. Returns 0, with nothing kept, when
        the pool has no room, the prefix exceeds the cache budget or it is
        cached already; on any error everything it reserved is released.
        """
        token_ids = list(bundle.token_ids)
        if len(token_ids) > self.cache.budget_tokens:
            return 0
        if self.kv_cache.radix.match(token_ids, bundle.salt, touch=False).num_tokens == len(token_ids):
            return 0
        import_id = ("import", next(self._import_counter))  # never a request id (those are str)
        reservation = self.kv_cache.reserve_import(import_id, token_ids, bundle.salt)
        if reservation is None:
            return 0
        try:
            if reservation.copy is not None:
                self.pool.copy_blocks([reservation.copy])
            start = reservation.num_cached_tokens
            scatter_rows(self.pool, self.kv_cache.block_table(import_id), start, bundle.rows[:, :, :, start:])
        except BaseException:
            self.kv_cache.release(import_id)
            raise
        num_new = self.kv_cache.finish(import_id, token_ids)
        self.num_imported_tokens += num_new
        return num_new

    def _check_tokens(self, token_ids: Sequence[int], what: str) -> None:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise ValueError(f"{what} must be a list of ints, got {type(token_ids).__name__}")
        for index, token in enumerate(token_ids):
            if type(token) is not int or not 0 <= token < self.vocab_size:
                raise ValueError(f"{what}[{index}] is {token!r}, not a token id in [0, {self.vocab_size})")

    # ----------------------------------------------------------------- stats
    @property
    def stats(self) -> dict:
        """A snapshot of the counters since start (a new dict each read).

        ``tokens_saved`` sums the prompt tokens reused at first admission (the
        sum of the results' per-request ``cached_tokens``); ``cache_num_tokens``
        is what the radix tree holds now (<= ``cache_budget_tokens``);
        ``kv_exported_tokens`` / ``kv_imported_tokens`` count positions copied
        out in bundles and newly cached from imported ones. ``attention_path``
        and ``forward_path`` say which kernels this replica runs
        (:class:`~worker.runner.ModelRunner`; strings, so /metrics skips them)."""
        return engine_stats(self)

    def load(self) -> dict:
        """What a router weighs against prefix affinity."""
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "queued_tokens": self.scheduler.queued_tokens(),
            "running_tokens": self.scheduler.running_tokens(),
            "kv_blocks_free": self.allocator.num_free_blocks,
        }

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        live = {seq.request_id for seq in (*self.scheduler.running, *self.scheduler.waiting)}
        assert live == set(self._live), (live, set(self._live))

