"""Pure-Python cache core: block hashing, the paged-KV block allocator, the
radix prefix cache and the KV cache that owns both. Imports neither torch nor ray."""

from cache.blocks import BlockAllocator, OutOfBlocks
from cache.hashing import block_hashes, chain_block_keys
from cache.kv_cache import KVCache, Reservation
from cache.radix import CachedEdge, CacheStats, MatchResult, RadixCache

__all__ = [
    "BlockAllocator",
    "CachedEdge",
    "CacheStats",
    "KVCache",
    "MatchResult",
    "OutOfBlocks",
    "RadixCache",
    "Reservation",
    "block_hashes",
    "chain_block_keys",
]
