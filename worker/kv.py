"""The KV pool: every layer's keys and values, indexed by block id.

One tensor ``data[num_layers, 2, kv_heads, num_blocks + 1, block_size,
head_dim]`` (index 0 of the second axis holds keys, 1 values). Block ids come
from ``cache.BlockAllocator``; the extra last block is scratch, never handed
out: padding tokens write there and masked key positions read from it.

Head-major across blocks: for each layer, kind and KV head the blocks lie
one after another, so positions of blocks ``b .. b + n - 1`` (consecutive
ids) of every head are one strided ``[kv_heads, n * block_size, head_dim]``
view (:meth:`run_view`) that attention reads in place, without a copy.
Row ``((head * (num_blocks + 1) + block_id) * block_size + offset)`` of
:meth:`rows` holds position ``block_id * block_size + offset`` of that head;
whole ``[rows, head_dim]`` *slabs* (:meth:`slabs`) are gathered where blocks
are scattered.
"""

from __future__ import annotations

import logging

import torch

from worker.model import KVGeometry

logger = logging.getLogger(__name__)


def bytes_per_token(geometry: KVGeometry, dtype: torch.dtype) -> int:
    """KV bytes one position costs: 2 × layers × kv_heads × head_dim × dtype bytes."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * element_size


def pool_tokens_from_free_memory(geometry: KVGeometry, dtype: torch.dtype, device: torch.device, fraction: float) -> int:
    """Positions that fit in ``fraction`` of the device's free memory (CUDA only)."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    return int(free_bytes * fraction) // bytes_per_token(geometry, dtype)


class KVPool:
    """Paged K/V storage. Invariant: only the engine's forward writes here, and
    only into slots of blocks the writing sequence holds alone (the allocator's
    copy-on-write guarantees that); :meth:`copy_block` is the only other writer."""

    def __init__(
        self, geometry: KVGeometry, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs >= 1 block of >= 1 slot, got {num_blocks} x {block_size}")
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block_id = num_blocks
        # [layers, k/v, kv_heads, num_blocks + 1, block_size, head_dim]
        self.data = torch.zeros(
            geometry.num_layers, 2, geometry.num_kv_heads, num_blocks + 1, block_size, geometry.head_dim,
            dtype=dtype, device=device,
        )
        self.num_bytes = self.data.numel() * self.data.element_size()
        logger.info(
            "KV pool: %d blocks x %d positions, %d bytes/token, %.1f MiB",
            num_blocks, block_size, bytes_per_token(geometry, dtype), self.num_bytes / 2**20,
        )

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def row_index(block_ids, heads, offsets, num_pool_blocks: int, block_size: int):
        """Row of :meth:`rows` holding (block, head, offset) (numpy or torch integers, broadcast);
        ``num_pool_blocks`` = ``num_blocks + 1`` (the scratch block included)."""
        return (heads * num_pool_blocks + block_ids) * block_size + offsets

    def rows(self, layer: int, kind: int) -> torch.Tensor:
        """``[kv_heads * (num_blocks + 1) * block_size, head_dim]`` view; ``kind`` 0 = keys, 1 = values."""
        return self.data[layer, kind].view(-1, self.geometry.head_dim)

    def slabs(self, layer: int, kind: int, rows_per_slab: int) -> torch.Tensor:
        """``[num_slabs, rows_per_slab, head_dim]`` view; ``rows_per_slab`` divides ``block_size``."""
        return self.data[layer, kind].view(-1, rows_per_slab, self.geometry.head_dim)

    def positions(self, layer: int, kind: int) -> torch.Tensor:
        """``[kv_heads, (num_blocks + 1) * block_size, head_dim]`` view: position ``p`` of block
        ``b`` is column ``b * block_size + p``; a run of consecutive block ids is a slice."""
        return self.data[layer, kind].view(self.geometry.num_kv_heads, -1, self.geometry.head_dim)

    def block_view(self, layer: int, kind: int) -> torch.Tensor:
        """``[num_blocks + 1, kv_heads, block_size, head_dim]`` view (strided, not a copy)."""
        return self.data[layer, kind].transpose(0, 1)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every layer's K/V rows of block ``src`` into ``dst`` for each pair, in order."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.data.device)
        dst = torch.tensor([d for _, d in pairs], device=self.data.device)
        self.data[:, :, :, dst] = self.data[:, :, :, src]

    def read_block(self, layer: int, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one block's ``(keys, values)``, each ``[kv_heads, block_size, head_dim]`` (tests)."""
        return self.data[layer, 0, :, block_id].clone(), self.data[layer, 1, :, block_id].clone()
