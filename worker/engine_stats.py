"""``Engine.stats`` assembled: the scheduler's counters since start, the
engine's load, the KV pool's and the radix cache's figures, KV transfer
totals and which kernels run, in one flat dict (a new one each read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine import Engine


def engine_stats(engine: Engine) -> dict:
    """What :attr:`Engine.stats <worker.engine.Engine.stats>` returns (the keys are documented there)."""
    c = engine.scheduler.counters
    lookups = c.hits + c.misses
    return {
        "hits": c.hits,
        "misses": c.misses,
        "hit_rate": c.hits / lookups if lookups else 0.0,
        "tokens_saved": c.tokens_saved,
        "readmission_tokens_saved": c.readmission_tokens_saved,
        "prefill_tokens": c.prefill_tokens,
        "decode_tokens": c.decode_tokens,
        "preemptions": c.preemptions,
        "inflight_holds": c.inflight_holds,
        "cow_copies": c.cow_copies,
        "num_finished": c.finished,
        "num_aborted": c.aborted,
        "num_steps": c.steps,
        **engine.load(),
        "kv_blocks_total": engine.allocator.num_blocks,
        "kv_block_size": engine.config.block_size,
        "kv_bytes_per_token": engine.bytes_per_token,
        "cache_num_tokens": engine.cache.num_tokens,
        "cache_budget_tokens": engine.cache.budget_tokens,
        "cache_protected_tokens": engine.cache.num_protected_tokens,
        "cache_evicted_tokens": engine.cache.stats.evicted_tokens,
        "kv_exported_tokens": engine.num_exported_tokens,
        "kv_imported_tokens": engine.num_imported_tokens,
        "deterministic": engine.config.deterministic,
        "model_id": engine.model_id,
        "attention_path": engine.runner.attention_path,
        "forward_path": engine.runner.forward_path,
    }
