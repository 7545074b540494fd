"""Pure-Python cache core: block hashing, the paged-KV block allocator and the
radix prefix cache. Imports neither torch nor ray."""

from cache.blocks import BlockAllocator, OutOfBlocks
from cache.hashing import block_hashes, chain_block_keys
from cache.radix import CachedEdge, CacheStats, MatchResult, RadixCache

__all__ = [
    "BlockAllocator",
    "CachedEdge",
    "CacheStats",
    "MatchResult",
    "OutOfBlocks",
    "RadixCache",
    "block_hashes",
    "chain_block_keys",
]
