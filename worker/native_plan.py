"""The native kernel's plan: which query rows it attends, grouped for worker/native/.

Built once per step from the step's :class:`ChunkArrays` and shared by every
layer. Each query token is a *member*: its row in the flattened batch, its
chunk's block table and its end (a token at position ``p`` attends positions
``[0, p + 1)``; the step's new keys are in the pool before attention runs).
:class:`worker.native.MemberGroups` groups members that share a cached prefix
(decodes of one system prompt; the tokens of one prefill chunk) so that the
prefix is read once per group.

Default mode runs decode tokens natively and leaves prefill chunks to the
torch kernel (worker/default_plan.py: its flash attention is faster on long
chunks). Deterministic mode runs every token natively
(:class:`NativePlan`): a row's result depends only on its query, its end and
the keys (the kernel's chunks are aligned to absolute positions), so a token
gets the same bits as a decode or inside any prefill chunk, which is what
``worker.reference.generate`` equality needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker import native
from worker.chunk_arrays import ChunkArrays


@dataclass(frozen=True, slots=True)
class NativeRows:
    """Members of one step for the native kernel, with the step's block tables."""

    tables: torch.Tensor  # [num_chunks, max_blocks] int64
    groups: native.MemberGroups

    @classmethod
    def of(cls, chunks: ChunkArrays, which: np.ndarray, max_members: int, device: torch.device) -> NativeRows:
        """Members: every token of the chunks ``which`` (indices into the step's chunks)."""
        lengths = chunks.lengths[which]
        member_tables = np.repeat(which, lengths)
        rank = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        member_rows = chunks.offsets[member_tables] + rank
        member_ends = chunks.starts[member_tables] + rank + 1
        tables = np.ascontiguousarray(chunks.tables, dtype=np.int64)
        groups = native.MemberGroups.of(tables, member_tables, member_rows, member_ends, chunks.block_size,
                                        chunks.num_kv_heads, max_members)
        return cls(torch.from_numpy(tables).to(device), groups)

    def attend_into(self, q: torch.Tensor, out: torch.Tensor, pool, layer: int, scale: float) -> None:
        """``q``/``out [T, heads, D]`` (strided views allowed): the members' rows of ``out``."""
        native.paged_attention(q, pool.data[layer, 0], pool.data[layer, 1], self.tables, self.groups,
                               pool.block_size, scale, out)


@dataclass(frozen=True, slots=True)
class NativePlan:
    """Every query token of the step attended by the native kernel (deterministic mode)."""

    rows: NativeRows
    num_tokens: int  # real rows; rows past them are padding (deterministic mode's fixed shapes): zeros

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool, layer: int, scale: float):
        """``q [heads, T, D]`` → ``[T, heads, D]``."""
        num_heads, num_rows, head_dim = q.shape
        make = q.new_empty if self.num_tokens == num_rows else q.new_zeros
        out = make(num_rows, num_heads, head_dim)
        self.rows.attend_into(q.transpose(0, 1), out, pool, layer, scale)
        return out


def build_native_plan(chunks: ChunkArrays, max_members: int, device: torch.device) -> NativePlan:
    return NativePlan(NativeRows.of(chunks, np.arange(len(chunks.lengths)), max_members, device),
                      int(chunks.lengths.sum()))
