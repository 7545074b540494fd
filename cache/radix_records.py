"""The radix tree's public records: lookup results, traversal edges, counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from cache.radix_node import Node, SaltKey


@dataclass(slots=True)
class CacheStats:
    """Counters since construction. Only ``match(..., touch=True)`` counts lookups."""

    hits: int = 0  # lookups that reused >= 1 token
    misses: int = 0
    tokens_saved: int = 0  # sum of matched tokens over lookups
    inserted_tokens: int = 0
    evictions: int = 0  # nodes removed (LRU leaves, and every node of an evicted namespace)
    evicted_tokens: int = 0
    evicted_namespaces: int = 0  # namespaces evicted whole to stay within max_namespaces
    uncached_inserts: int = 0  # inserts refused because every namespace was locked at the cap


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a lookup.

    ``block_ids``: ``ceil(num_tokens / block_size)`` blocks holding positions
    ``[0, num_tokens)`` (empty in simulated mode); all but a partly matched last
    one can be shared by reference, that one must be copied before writing.
    Pass the result itself to :meth:`RadixCache.lock` to pin those positions
    while the blocks are in use; where the match ended is opaque.
    """

    num_tokens: int
    block_ids: tuple[int, ...]
    _node: Node = field(repr=False, compare=False)


@dataclass(slots=True)
class CachedEdge:
    """One node of the tree as :meth:`RadixCache.edges` walks it.

    ``tokens`` hold positions ``[start, start + len(tokens))`` of every cached
    sequence through this node; ``depth`` is 0 for a node hanging from its
    namespace's root, its parent's depth + 1 otherwise. ``block_ids`` are the
    blocks it names (empty in simulated mode); ``num_locks`` the locks held on
    it or below it. A fresh record per node (not frozen: building one is a
    third of the cost, and the summary walk builds one per node under the
    engine lock).
    """

    namespace: SaltKey
    depth: int
    start: int
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    num_locks: int
