"""What the radix tree checks, kept apart from what it does (the tree's own
code: only cache/radix.py calls it).

Two kinds of failure: ``ValueError`` for a caller's misuse (the
constructor's arguments, an insert's block ids), ``assert`` for the tree's
own invariants (:func:`audit_tree`, the body of
:meth:`RadixCache.check_invariants`, which tests call after every
operation). The audit walks every namespace and holds what it counts against
the tree's private counters, its eviction queues and the allocator's
retained references.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache.blocks import BlockAllocator
from cache.radix_node import Root, linked_nodes

if TYPE_CHECKING:
    from cache.radix import RadixCache


def check_arguments(budget_tokens: int, block_size: int, allocator: BlockAllocator | None,
                    protected_share: float) -> None:
    """``RadixCache(...)``'s arguments; ``ValueError`` names the first bad one."""
    if type(budget_tokens) is not int or budget_tokens < 0:
        raise ValueError(f"budget_tokens must be a non-negative int, got {budget_tokens!r}")
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(protected_share, bool) or not isinstance(protected_share, (int, float)) \
            or not 0.0 <= protected_share <= 1.0:
        raise ValueError(f"protected_share must be within [0, 1], got {protected_share!r}")
    if allocator is not None and allocator.block_size != block_size:
        raise ValueError(f"allocator block_size {allocator.block_size} != block_size {block_size}")


def check_block_ids(allocator: BlockAllocator | None, block_size: int, num_tokens: int,
                    block_ids: Sequence[int] | None) -> None:
    """An insert's ``block_ids``: none in simulated mode; in real mode at least
    ``ceil(num_tokens / block_size)`` ids, each held by a sequence."""
    num_needed_blocks = -(-num_tokens // block_size)
    if allocator is None:
        if block_ids is not None:
            raise ValueError("simulated RadixCache takes no block_ids")
    elif block_ids is None or len(block_ids) < num_needed_blocks:
        got = "none" if block_ids is None else len(block_ids)
        raise ValueError(f"{num_tokens} tokens need {num_needed_blocks} block ids, got {got}")
    else:
        for block_id in block_ids[:num_needed_blocks]:
            if allocator.ref_count(block_id) == 0:
                raise ValueError(f"insert names free block {block_id}; cache only blocks a sequence holds")


def audit_tree(radix: RadixCache) -> None:
    """Assert the invariants of :class:`RadixCache`'s docstring: a walk of every
    namespace (links checked by :func:`linked_nodes`) recounts the cached,
    locked and protected positions, the nodes and the locks, and each block's
    retained references; every evictable leaf is queued for eviction."""
    total_tokens, total_nodes, locked_tokens, locks_in_tree, protected_tokens = 0, 0, 0, 0, 0
    retained: dict[int, int] = {}
    queued, recency = radix._lru.live_keys(), radix._lru.recency_keys()
    assert len(radix._namespaces) <= radix._namespaces.max_namespaces
    for root in radix._namespaces:
        assert isinstance(root, Root) and radix._namespaces.holds(root), root
        assert root.namespace is None or type(root.namespace) is bytes, root.namespace
        assert root.lock_ref >= 1 and root.start == 0 and not root.tokens
        assert root.children or root.lock_ref > 1, f"an emptied namespace was kept: {root.namespace!r}"
        locks_in_tree += root.lock_ref - 1
        for node in linked_nodes(root):
            total_tokens += len(node.tokens)
            total_nodes += 1
            if node.lock_ref:
                locked_tokens += len(node.tokens)
            assert node.last_access >= max((c.last_access for c in node.children.values()), default=0)
            if radix._is_evictable(node):
                assert (id(node), node.last_access) in queued, f"evictable leaf not queued: {node!r}"
            if node.is_protected:
                protected_tokens += len(node.tokens)
                assert (id(node), node.last_access) in recency, f"protected node not in recency order: {node!r}"
            if radix.allocator is not None:
                first, last = node.start // radix.block_size, (node.end - 1) // radix.block_size
                assert len(node.block_ids) == last - first + 1, node
                for block_id in node.block_ids:
                    retained[block_id] = retained.get(block_id, 0) + 1
    assert total_tokens == radix._num_tokens <= radix.budget_tokens, (total_tokens, radix._num_tokens)
    assert locked_tokens == radix._num_locked_tokens, (locked_tokens, radix._num_locked_tokens)
    assert total_nodes == radix._num_nodes
    assert protected_tokens == radix._lru.num_protected_tokens, protected_tokens
    radix._lru.check_invariants()
    assert locks_in_tree <= radix._num_locks, (locks_in_tree, radix._num_locks)  # the rest: on unknown namespaces
    if radix.allocator is not None:
        for block_id, count in retained.items():
            assert radix.allocator.retained_count(block_id) == count, block_id
