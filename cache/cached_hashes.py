"""What a radix cache holds, as the router sees it: the chained hashes of
every full block it caches (:func:`cached_block_hashes`).

A worker reports them (at the router's block size, per salt) so the router
can tell which replica holds a prompt's prefix with the same
:func:`cache.block_hashes` it computes itself; :class:`cache.summary.CacheSummary`
carries them.
"""

from __future__ import annotations

from cache.hashing import continue_block_hashes, salt_seed
from cache.radix import RadixCache


def cached_block_hashes(radix: RadixCache, block_size: int) -> set[int]:
    """Chained hashes of every full ``block_size`` block cached in ``radix``.

    Equal to the union of ``block_hashes(path, block_size, salt)`` over every
    root-to-node path of every salt namespace (the tree keys a namespace by
    its salt as bytes, which :func:`cache.hashing.salt_seed` hashes like the
    str). One pass over :meth:`RadixCache.edges`: cost O(cached tokens +
    nodes × block_size), both bounded by the tree's budget; reads only (no
    LRU touch).
    """
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    hashes: set[int] = set()
    # along the current path, per depth: the chain value of the last full block
    # up to the end of that edge, and the tokens of the partial block after it
    chain: list[tuple[int, tuple[int, ...]]] = []
    for edge in radix.edges():
        del chain[edge.depth :]
        parent_hash, pending = chain[-1] if chain else (salt_seed(edge.namespace), ())
        tokens = pending + edge.tokens
        num_full = len(tokens) // block_size
        chained = continue_block_hashes(parent_hash, tokens[: num_full * block_size], block_size)
        hashes.update(chained)
        chain.append((chained[-1] if chained else parent_hash, tokens[num_full * block_size :]))
    return hashes
