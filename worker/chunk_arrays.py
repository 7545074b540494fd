"""One step's chunks as arrays: what every attention plan is built from.

:func:`worker.step.build_step` makes one :class:`ChunkArrays` per step from
the scheduler's chunks; the default kernel (worker/attention.py) and the
batch-invariant one (worker/tiled_attention.py) each build their plan from
it. It depends on nothing but numpy, so neither kernel imports the other or
the step module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ChunkArrays:
    """The step's chunks as arrays (one entry per chunk)."""

    offsets: np.ndarray  # first row of the chunk in the flattened batch
    lengths: np.ndarray  # tokens fed this step
    starts: np.ndarray  # absolute position of the first fed token
    tables: np.ndarray  # [num_chunks, max_blocks] block tables, padded with the scratch block
    block_size: int
    scratch_block: int
    num_kv_heads: int

    @property
    def ends(self) -> np.ndarray:
        """Sequence length after this step (positions ``< end`` hold keys)."""
        return self.starts + self.lengths

    def blocks(self, chunk: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Block ids holding ``positions`` (same shape) for chunk ``chunk``; scratch past the end."""
        index = np.minimum(positions // self.block_size, self.tables.shape[1] - 1)
        return np.where(positions < self.ends[chunk], self.tables[chunk, index], self.scratch_block)

    def slab_ids(self, blocks: np.ndarray, heads: np.ndarray, positions: np.ndarray, rows_per_slab: int) -> np.ndarray:
        """Index of the slab holding (block, head, position) in a ``rows_per_slab``-row slab view of the pool."""
        offset = positions % self.block_size
        return self.pool_rows(blocks, heads, offset) // rows_per_slab

    def pool_rows(self, blocks: np.ndarray, heads: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Row of ``KVPool.rows`` holding (block, head, offset within the block), broadcast.
        The pool is head-major across blocks (worker/kv.py): ``scratch_block + 1`` blocks per head."""
        return (heads * (self.scratch_block + 1) + blocks) * self.block_size + offsets
