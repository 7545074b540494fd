"""What a radix cache holds, as the router sees it: chained block hashes.

A worker reports the hashes of every full block its tree caches (at the
router's block size, per salt), so the router can tell which replica holds a
prompt's prefix with the same :func:`cache.block_hashes` it computes itself.
"""

from __future__ import annotations

from cache.hashing import continue_block_hashes, salt_seed
from cache.radix import RadixCache, _Node


def cached_block_hashes(radix: RadixCache, block_size: int) -> set[int]:
    """Chained hashes of every full ``block_size`` block cached in ``radix``.

    Equal to the union of ``block_hashes(path, block_size, salt)`` over every
    root-to-node path of every salt namespace. Cost O(cached tokens +
    nodes × block_size); reads only (no LRU touch).
    """
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    hashes: set[int] = set()
    for salt, root in radix._roots.items():
        # Each stack entry: a node, the chain value of the last full block above
        # it, and the tokens of the partial block that straddles into it.
        stack: list[tuple[_Node, int, tuple[int, ...]]] = [
            (child, salt_seed(salt), ()) for child in root.children.values()
        ]
        while stack:
            node, parent_hash, pending = stack.pop()
            tokens = pending + node.tokens
            num_full = len(tokens) // block_size
            chained = continue_block_hashes(parent_hash, tokens[: num_full * block_size], block_size)
            hashes.update(chained)
            last_hash = chained[-1] if chained else parent_hash
            rest = tokens[num_full * block_size :]
            for child in node.children.values():
                stack.append((child, last_hash, rest))
    return hashes
