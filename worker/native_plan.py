"""The native kernel's plan: which query rows it attends, grouped for worker/native/.

Built once per step from the step's :class:`ChunkArrays` and shared by every
layer. Each query token is a *member*: its row in the flattened batch, its
chunk's block table and its end (a token at position ``p`` attends positions
``[0, p + 1)``; the step's new keys are in the pool before attention runs).
:class:`worker.native.MemberGroups` groups members that share a cached prefix
(decodes of one system prompt; the tokens of one prefill chunk) so that the
prefix is read once per group.

Both modes run every token natively (:class:`NativePlan`): a row's result
depends only on its query, its end and the keys (the kernel's chunks are
aligned to absolute positions), so a token gets the same bits as a decode or
inside any prefill chunk, which is what deterministic mode's
``worker.reference.generate`` equality needs; default mode takes it because
it is also the fastest kernel here (a short prefill chunk over a cached
prefix is read with the decodes sharing that prefix, in one call per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker import native
from worker.chunk_arrays import ChunkArrays


@dataclass(frozen=True, slots=True)
class NativePlan:
    """Every query token of the step attended by the native kernel."""

    tables: torch.Tensor  # [num_chunks, max_blocks] int64: the step's block tables
    groups: native.MemberGroups  # the tokens (members), grouped by shared prefix
    num_tokens: int  # real rows; rows past them are padding (deterministic mode's fixed shapes): zeros

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool, layer: int, scale: float):
        """``q [heads, T, D]`` → ``[T, heads, D]``."""
        num_heads, num_rows, head_dim = q.shape
        make = q.new_empty if self.num_tokens == num_rows else q.new_zeros
        out = make(num_rows, num_heads, head_dim)
        native.paged_attention(q.transpose(0, 1), pool.data[layer, 0], pool.data[layer, 1], self.tables, self.groups,
                               pool.block_size, scale, out)
        return out


def build_native_plan(chunks: ChunkArrays, max_members: int, device: torch.device) -> NativePlan:
    """Members: every token of every chunk (a token at position ``p`` ends at ``p + 1``), in groups
    of at most ``max_members``."""
    lengths = chunks.lengths
    member_tables = np.repeat(np.arange(len(lengths)), lengths)
    rank = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    member_rows = chunks.offsets[member_tables] + rank
    member_ends = chunks.starts[member_tables] + rank + 1
    tables = np.ascontiguousarray(chunks.tables, dtype=np.int64)
    groups = native.MemberGroups.of(tables, member_tables, member_rows, member_ends, chunks.block_size,
                                    chunks.num_kv_heads, max_members)
    return NativePlan(torch.from_numpy(tables).to(device), groups, int(lengths.sum()))
