"""Paged-KV bookkeeping: which physical blocks each sequence uses, and who
else holds them.

No tensors live here. The engine owns a KV pool indexed by block id and does
the copies this module asks for (``(src, dst)`` pairs); this module only says
which rows go where.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

SeqId = Hashable


class OutOfBlocks(Exception):
    """The free list is too short for the request. Nothing was changed."""

    def __init__(self, num_needed: int, num_free: int) -> None:
        super().__init__(f"need {num_needed} free blocks, have {num_free}")
        self.num_needed = num_needed
        self.num_free = num_free


@dataclass(slots=True)
class _Sequence:
    """One sequence's view of the pool.

    ``block_ids[i]`` holds positions ``[i * block_size, (i + 1) * block_size)``;
    ``num_tokens`` positions are reserved, so
    ``len(block_ids) == ceil(num_tokens / block_size)``.
    """

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


def _num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Free list, per-sequence block tables and reference counts.

    Invariants (checked by :meth:`check_invariants`):

    1. ``ref_count(b)`` equals the number of block-table entries naming ``b``
       plus the external references taken with :meth:`retain` (the radix
       tree's); a block is on the free list iff its count is 0, exactly once.
    2. A sequence of ``n`` reserved positions has ``ceil(n / block_size)``
       blocks.
    3. Writes only go to blocks the writer holds alone: :meth:`append` copies
       a shared last block first (copy-on-write) and returns ``(src, dst)``.

    Allocation order: blocks are taken from the front of the free list and
    returned to its back, so a fresh allocator hands out ``0, 1, 2, ...`` and a
    freed block is reused last (least recently freed first).

    Failures: a caller's misuse (unknown id, double free, bad size) raises
    ``KeyError``/``ValueError``; a pool too small raises :class:`OutOfBlocks`.
    Both leave the state unchanged.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._external_refs: list[int] = [0] * num_blocks
        self._seqs: dict[SeqId, _Sequence] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> Iterator[SeqId]:
        """The sequences that hold a block table, in allocation order."""
        return iter(self._seqs)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's block ids, in position order."""
        return list(self._get(seq_id).block_ids)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._get(seq_id).num_tokens

    def ref_count(self, block_id: int) -> int:
        self._check_block_id(block_id)
        return self._ref_counts[block_id]

    def retained_count(self, block_id: int) -> int:
        """References taken with :meth:`retain` and not yet released."""
        self._check_block_id(block_id)
        return self._external_refs[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def fragmentation(self) -> dict[str, int | float]:
        """Internal fragmentation over the distinct blocks that sequences hold.

        ``allocated_slots``: positions in those blocks; ``used_slots``: positions
        some sequence has reserved (a shared block counts once, as filled as its
        fullest holder); ``wasted_slots``: the difference, the tails of partly
        filled blocks. Blocks held only by :meth:`retain` are not counted.
        """
        filled: dict[int, int] = {}
        bs = self.block_size
        for seq in self._seqs.values():
            for index, block_id in enumerate(seq.block_ids):
                used = min(bs, seq.num_tokens - index * bs)
                if used > filled.get(block_id, 0):
                    filled[block_id] = used
        allocated = len(filled) * bs
        used = sum(filled.values())
        return {
            "allocated_slots": allocated,
            "used_slots": used,
            "wasted_slots": allocated - used,
            "wasted_fraction": (allocated - used) / allocated if allocated else 0.0,
        }

    # -------------------------------------------------------------- sequences
    def allocate(self, seq_id: SeqId, num_tokens: int) -> list[int]:
        """Give a new sequence fresh blocks for ``num_tokens`` positions."""
        self._check_new(seq_id)
        self._check_count(num_tokens, "num_tokens")
        block_ids = self._take(_num_blocks_for(num_tokens, self.block_size))
        self._seqs[seq_id] = _Sequence(block_ids, num_tokens)
        return list(block_ids)

    def allocate_with_prefix(
        self,
        seq_id: SeqId,
        num_tokens: int,
        prefix_block_ids: Sequence[int],
        num_prefix_tokens: int,
    ) -> tuple[int, int] | None:
        """Start a sequence whose first ``num_prefix_tokens`` positions are cached.

        ``prefix_block_ids`` hold those positions (``ceil(num_prefix_tokens /
        block_size)`` blocks, e.g. a radix-cache match). Full blocks are shared
        by reference; a partly filled last one is copied into a fresh block so
        the new sequence can write its remaining rows: the returned ``(src,
        dst)`` asks the caller to copy those KV rows. Fresh blocks cover the
        rest up to ``num_tokens``.
        """
        self._check_new(seq_id)
        self._check_count(num_tokens, "num_tokens")
        self._check_count(num_prefix_tokens, "num_prefix_tokens")
        bs = self.block_size
        if num_prefix_tokens > num_tokens:
            raise ValueError(f"num_prefix_tokens {num_prefix_tokens} > num_tokens {num_tokens}")
        if len(prefix_block_ids) != _num_blocks_for(num_prefix_tokens, bs):
            raise ValueError(
                f"{len(prefix_block_ids)} prefix blocks cannot hold exactly {num_prefix_tokens} tokens"
                f" at block_size {bs}"
            )
        for block_id in prefix_block_ids:
            self._check_block_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"prefix block {block_id} is free; only held blocks can be shared")
        num_shared = num_prefix_tokens // bs
        has_partial = num_prefix_tokens % bs != 0
        num_fresh = _num_blocks_for(num_tokens, bs) - num_shared
        fresh = self._take(num_fresh)
        shared = list(prefix_block_ids[:num_shared])
        for block_id in shared:
            self._ref_counts[block_id] += 1
        self._seqs[seq_id] = _Sequence(shared + fresh, num_tokens)
        if has_partial:
            return prefix_block_ids[num_shared], fresh[0]
        return None

    def append(self, seq_id: SeqId) -> tuple[int, int] | None:
        """Reserve one more position; copy-on-write if the last block is shared.

        Returns ``(src, dst)`` when the last block was shared and has been
        replaced by a private copy (the caller copies KV rows ``src → dst``),
        else ``None``. Raises :class:`OutOfBlocks` (state unchanged) when a new
        or copied block is needed and none is free.
        """
        seq = self._get(seq_id)
        if seq.num_tokens % self.block_size == 0:
            seq.block_ids.extend(self._take(1))
            seq.num_tokens += 1
            return None
        last = seq.block_ids[-1]
        copy = None
        if self._ref_counts[last] > 1:
            (dst,) = self._take(1)
            self._ref_counts[last] -= 1
            seq.block_ids[-1] = dst
            copy = (last, dst)
        seq.num_tokens += 1
        return copy

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares every parent block (ref counts +1); no copying."""
        parent = self._get(parent_id)
        self._check_new(child_id)
        for block_id in parent.block_ids:
            self._ref_counts[block_id] += 1
        self._seqs[child_id] = _Sequence(list(parent.block_ids), parent.num_tokens)

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence; blocks nobody else holds go back to the free list."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for block_id in reversed(seq.block_ids):
            self._drop_ref(block_id)

    # ---------------------------------------------------- external references
    def retain(self, block_id: int) -> None:
        """Take an extra reference to a held block (e.g. the radix tree caching it)."""
        self._check_block_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; retain only blocks someone holds")
        self._ref_counts[block_id] += 1
        self._external_refs[block_id] += 1

    def release(self, block_id: int) -> None:
        """Drop a reference taken with :meth:`retain`."""
        self._check_block_id(block_id)
        if self._external_refs[block_id] == 0:
            raise ValueError(f"block {block_id} has no retained reference to release")
        self._external_refs[block_id] -= 1
        self._drop_ref(block_id)

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        expected = list(self._external_refs)
        for seq_id, seq in self._seqs.items():
            assert len(seq.block_ids) == _num_blocks_for(seq.num_tokens, self.block_size), seq_id
            for block_id in seq.block_ids:
                expected[block_id] += 1
        assert expected == self._ref_counts, "ref counts disagree with tables + retains"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, count in enumerate(self._ref_counts):
            assert (count == 0) == (block_id in free), f"block {block_id}: count {count}"

    # ---------------------------------------------------------------- private
    def _take(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise OutOfBlocks(num_blocks, len(self._free))
        taken = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in taken:
            self._ref_counts[block_id] = 1
        return taken

    def _drop_ref(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free.append(block_id)

    def _get(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r}") from None

    def _check_new(self, seq_id: SeqId) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence id {seq_id!r} already has blocks")

    def _check_count(self, value: int, name: str) -> None:
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")

    def _check_block_id(self, block_id: int) -> None:
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is not in [0, {self.num_blocks})")
