"""An engine's self-check between steps: its invariants and where every KV
block is.

Each Worker replica runs :func:`audit` when its engine is idle and posts the
result with its stats (``GET /stats``), so an operator or a test can see after
any load — disconnects, aborts, preemptions — that nothing leaked: with no
request in flight every block is either free or held only by the radix cache
(``kv_blocks_unaccounted == 0``), nothing is locked, and
``check_invariants()`` passes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Audit:
    """One audit of an engine, taken under the engine lock between steps.

    ``kv_blocks_cached_only``: blocks whose every reference is the radix
    tree's; ``kv_blocks_in_use``: blocks some request's block table names.
    ``kv_blocks_unaccounted`` (only when ``is_idle``): blocks neither free nor
    held only by the cache — a leak, since no request is in flight.
    """

    is_idle: bool
    invariants: str  # "ok", or the failed check's message
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached_only: int
    kv_blocks_in_use: int
    cache_locked_tokens: int
    kv_blocks_unaccounted: int | None

    @property
    def is_clean(self) -> bool:
        return (
            self.invariants == "ok"
            and self.is_idle
            and self.kv_blocks_unaccounted == 0
            and self.kv_blocks_in_use == 0
            and self.cache_locked_tokens == 0
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "is_clean": self.is_clean}


def audit(async_engine) -> Audit:
    """Check ``async_engine`` (a :class:`worker.AsyncEngine`) between two steps.

    Blocks the engine for one pass over the pool and the tree (milliseconds
    for tens of thousands of blocks); callers run it when the engine is idle.
    """
    with async_engine.locked() as engine:
        try:
            async_engine.check_invariants()
            invariants = "ok"
        except AssertionError as error:
            invariants = f"AssertionError: {error}"[:500]
        allocator = engine.allocator
        is_idle = not engine.has_work()
        num_free = allocator.num_free_blocks
        num_cached_only = num_in_use = 0
        for block_id in range(allocator.num_blocks):
            count = allocator.ref_count(block_id)
            if count == 0:
                continue
            if count == allocator.retained_count(block_id):
                num_cached_only += 1
            else:
                num_in_use += 1
        return Audit(
            is_idle=is_idle,
            invariants=invariants,
            kv_blocks_total=allocator.num_blocks,
            kv_blocks_free=num_free,
            kv_blocks_cached_only=num_cached_only,
            kv_blocks_in_use=num_in_use,
            cache_locked_tokens=engine.cache.num_locked_tokens,
            kv_blocks_unaccounted=allocator.num_blocks - num_free - num_cached_only if is_idle else None,
        )
