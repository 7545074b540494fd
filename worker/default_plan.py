"""The default attention kernel's plan: which keys each query reads, and how.

Built once per step (numpy, O(blocks) work, no per-position Python) from the
step's :class:`ChunkArrays` and shared by every layer; worker/attention.py
executes it.

A sequence's context is cut into *segments*: maximal runs of consecutive
block ids whose blocks the same number of the step's decodes hold. The pool
is head-major across blocks (worker/kv.py), so a segment of every KV head is
one strided view of the pool, read in place:

- A segment of at least ``min_in_place_tokens`` positions is attended
  straight from the pool (:class:`InPlaceCall`); decodes holding the same
  segment (a cached prefix: the same blocks) attend it together, their query
  heads as rows of one query. Segments of the same length and sharer count
  whose starts are evenly spaced in the pool (sequences allocated one after
  another) share one call: a batch of strided views (``as_strided``).
- Shorter pieces (decode-grown blocks, allocated interleaved across
  sequences; fragmented tables) are gathered as before
  (:class:`GatherRound`): a decode's scattered blocks in key pieces of up to
  ``DECODE_KEY_CHUNK`` positions, a short shared segment once for all its
  holders, rounds of at most ``scratch_tokens`` positions, padded to the
  round's longest piece and masked past each piece's end.
- A prefill chunk attends its own new keys from the step (causal), its
  cached prefix's long segments in place and its short ones gathered in
  rounds of at most ``scratch_tokens`` positions.

Every partial result comes with its log-sum-exp; worker/attention.py merges
them (online softmax). Attention does not depend on key order, so a
segment's place in the context does not matter, only which positions it
holds. Scratch: what is gathered is bounded as before; in-place reads need
none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker.chunk_arrays import ChunkArrays

DECODE_KEY_CHUNK = 128  # positions per gathered decode piece (rounded up to whole blocks)
DEFAULT_SCRATCH_TOKENS = 32768  # K/V positions one round may gather
MIN_IN_PLACE_TOKENS = 32  # shorter segments are gathered (one call per short run costs more than its copy)
NEVER_IN_PLACE = 1 << 62  # min_in_place_tokens that gathers everything (the gather-only kernel; tests, A/B)


@dataclass(slots=True)
class InPlaceCall:
    """``units`` segments of ``length`` positions each, read by ``sharers`` decodes each, attended
    in one call straight from the pool: unit ``u`` starts at pool column ``start + u * step``
    (``KVPool.positions``). Its query rows are ``q_index[rows]`` (unit-major, then sharer)."""

    rows: slice
    units: int
    sharers: int
    length: int
    start: int
    step: int


@dataclass(slots=True)
class GatherRound:
    """Gathered pieces that the same number of decodes read: ``seqs[u]`` are the decodes
    (indices among the step's decodes) attending piece ``u``."""

    seqs: torch.Tensor  # [pieces, sharers]
    slabs: torch.Tensor  # [pieces * kv_heads * blocks_per_piece] block slabs (one block of one head each)
    mask: torch.Tensor | None  # [pieces, 1, 1, key_len] 0 where visible, -inf past the end; None: all visible
    key_len: int


@dataclass(slots=True)
class PrefillWork:
    row: int  # first row of the chunk in the flattened batch
    length: int
    in_place: list[tuple[int, int]]  # (first pool column, positions) of each long cached segment
    past_rounds: list[torch.Tensor]  # each [kv_heads * n] pool rows of n gathered cached positions, head-major


@dataclass(slots=True)
class DefaultPlan:
    decode_rows: torch.Tensor | None  # [num_decodes] rows of one-token chunks
    q_index: torch.Tensor | None  # decodes (indices among the step's) of every in-place call's rows, in call order
    in_place: list[InPlaceCall]
    decode_rounds: list[GatherRound]
    prefills: list[PrefillWork]
    key_chunk: int  # positions per gathered decode piece
    merge_pairs: int = 1  # decode partial results held before they are merged
    stats: dict = field(default_factory=dict)  # positions read in place / gathered (tests, profiling)

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool, layer: int, scale: float):
        """``q [heads, T, D]``, this step's ``key``/``value [kv_heads, T, D]`` → ``[T, heads, D]``."""
        from worker.attention import default_attention

        return default_attention(q, key, value, pool, layer, self, scale)


def _rank_within(sizes: np.ndarray) -> np.ndarray:
    """``[0 .. sizes[0]), [0 .. sizes[1]), ...`` concatenated: each element's index within its
    group, for groups laid out by ``np.repeat(..., sizes)``."""
    return np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def segments(tables: np.ndarray, ends: np.ndarray, block_size: int, counts_of=None):
    """Each row's first ``ceil(end / block_size)`` blocks cut into maximal runs of consecutive
    ids (and, with ``counts_of``, of equal holder counts). Returns per segment: row, first
    block index, first block id, number of blocks, positions held, holder count (1 without)."""
    num_blocks = -(-ends // block_size)
    row = np.repeat(np.arange(len(ends)), num_blocks)
    index = _rank_within(num_blocks)
    blocks = tables[row, index]
    holders = counts_of(blocks) if counts_of is not None else np.ones(len(blocks), dtype=np.int64)
    new = np.ones(len(blocks), dtype=bool)
    new[1:] = (row[1:] != row[:-1]) | (blocks[1:] != blocks[:-1] + 1) | (holders[1:] != holders[:-1])
    first = np.flatnonzero(new)
    size = np.diff(np.append(first, len(blocks)))
    seg_row, seg_index = row[first], index[first]
    held = np.minimum(size * block_size, ends[seg_row] - seg_index * block_size)
    return seg_row, seg_index, blocks[first], size, held, holders[first]


def build_default_plan(
    chunks: ChunkArrays, device: torch.device, scratch_tokens: int = DEFAULT_SCRATCH_TOKENS,
    min_in_place_tokens: int | None = None,
) -> DefaultPlan:
    """``scratch_tokens``: most K/V positions gathered at once (at least one piece);
    ``min_in_place_tokens``: shortest segment read in place (None: :data:`MIN_IN_PLACE_TOKENS`,
    read at call time; :data:`NEVER_IN_PLACE`: none, the gather-only kernel)."""
    if min_in_place_tokens is None:
        min_in_place_tokens = MIN_IN_PLACE_TOKENS
    bs = chunks.block_size
    key_chunk = -(-DECODE_KEY_CHUNK // bs) * bs
    is_decode = chunks.lengths == 1
    decode = np.flatnonzero(is_decode)
    plan = DefaultPlan(None, None, [], [], [], key_chunk, stats={"in_place": 0, "gathered": 0})
    if len(decode):
        plan.decode_rows = torch.from_numpy(chunks.offsets[decode]).to(device)
        _plan_decodes(plan, chunks, decode, scratch_tokens, min_in_place_tokens, device)
    heads = np.arange(chunks.num_kv_heads)[:, None]
    step_tokens = max(bs, scratch_tokens)
    for index in np.flatnonzero(~is_decode):
        start = int(chunks.starts[index])
        in_place, past_rounds = [], []
        if start:
            _, first, block0, size, held, _ = segments(chunks.tables[index : index + 1], np.array([start]), bs)
            long = held >= min_in_place_tokens
            in_place = [(int(b) * bs, int(n)) for b, n in zip(block0[long], held[long])]
            # The short segments' positions, gathered in rounds (O(blocks) numpy; positions only of those)
            short = np.flatnonzero(~long)
            positions = np.repeat(first[short] * bs, held[short]) + _rank_within(held[short])
            for lo in range(0, len(positions), step_tokens):
                part = positions[lo : lo + step_tokens]
                blocks = chunks.tables[index, part // bs]
                past_rounds.append(torch.from_numpy(chunks.pool_rows(blocks[None, :], heads, part[None, :] % bs)
                                                    .reshape(-1)).to(device))
            plan.stats["in_place"] += int(held[long].sum())
            plan.stats["gathered"] += len(positions)
        plan.prefills.append(PrefillWork(int(chunks.offsets[index]), int(chunks.lengths[index]), in_place, past_rounds))
    return plan


def _plan_decodes(plan: DefaultPlan, chunks: ChunkArrays, decode, scratch_tokens, min_in_place_tokens, device) -> None:
    bs, num_kv_heads = chunks.block_size, chunks.num_kv_heads
    per_round = max(1, scratch_tokens // plan.key_chunk)
    plan.merge_pairs = max(len(decode), per_round)
    tables, ends = chunks.tables[decode], chunks.ends[decode]
    num_blocks = -(-ends // bs)
    held_blocks = tables[np.arange(tables.shape[1])[None, :] < num_blocks[:, None]]
    ids, holder_count = np.unique(held_blocks, return_counts=True)
    seg_seq, seg_index, seg_block, seg_size, seg_held, seg_holders = segments(
        tables, ends, bs, counts_of=lambda b: holder_count[np.searchsorted(ids, b)]
    )
    # Units: a shared segment (same first block, size and positions) once for all its holders.
    key = np.stack([seg_block, seg_size, seg_held], axis=1)
    shared = np.flatnonzero(seg_holders > 1)
    unit_of = np.arange(len(seg_seq))  # unshared: a unit each
    if len(shared):
        _, first, inverse = np.unique(key[shared], axis=0, return_index=True, return_inverse=True)
        unit_of[shared] = shared[first][inverse.reshape(-1)]
    order = np.argsort(unit_of, kind="stable")
    unit_ids, unit_start, sharers = np.unique(unit_of[order], return_index=True, return_counts=True)
    members = np.split(seg_seq[order], unit_start[1:])  # decodes reading each unit
    held = seg_held[unit_ids]
    in_place = held >= min_in_place_tokens
    plan.stats["in_place"] += int((held * sharers)[in_place].sum())
    plan.stats["gathered"] += int((held * sharers)[~in_place].sum())

    # In-place calls: units grouped by (sharers, length); evenly spaced starts share a call.
    q_index, row = [], 0
    cols = seg_block[unit_ids] * bs
    for s in np.unique(sharers[in_place]):
        for length in np.unique(held[in_place & (sharers == s)]):
            group = np.flatnonzero(in_place & (sharers == s) & (held == length))
            group = group[np.argsort(cols[group], kind="stable")]
            lo = 0
            while lo < len(group):
                hi = lo + 1
                step = int(cols[group[hi]] - cols[group[lo]]) if hi < len(group) else 0
                while hi < len(group) and cols[group[hi]] - cols[group[hi - 1]] == step:
                    hi += 1
                run = group[lo:hi]
                q_index.extend(members[u] for u in run)
                count = len(run) * int(s)
                plan.in_place.append(InPlaceCall(slice(row, row + count), len(run), int(s), int(length),
                                                 int(cols[run[0]]), step))
                row += count
                lo = hi
    if q_index:
        plan.q_index = torch.from_numpy(np.concatenate(q_index)).to(device)

    # Gathered pieces: a short shared segment as it is; a decode's short unshared blocks, in table
    # order (only its last block can be partial: held positions are a prefix), in key_chunk pieces.
    piece_blocks, piece_held, piece_seqs = [], [], []
    short_shared = np.flatnonzero(~in_place & (sharers > 1))
    for u in short_shared:
        seg = unit_ids[u]
        piece_blocks.append(np.arange(seg_block[seg], seg_block[seg] + seg_size[seg]))
        piece_held.append(int(held[u]))
        piece_seqs.append(members[u])
    own = unit_ids[~in_place & (sharers == 1)]  # segments, in (decode, position) order
    if len(own):
        block_seq = np.repeat(seg_seq[own], seg_size[own])
        block_id = np.repeat(seg_block[own], seg_size[own]) + _rank_within(seg_size[own])
        block_held = np.full(len(block_id), bs)
        last_of_seg = np.cumsum(seg_size[own]) - 1
        block_held[last_of_seg] = seg_held[own] - (seg_size[own] - 1) * bs
        rank = np.arange(len(block_seq)) - np.searchsorted(block_seq, block_seq)  # k-th short block of its decode
        piece = np.cumsum(np.r_[True, (block_seq[1:] != block_seq[:-1]) | (rank[1:] % (plan.key_chunk // bs) == 0)]) - 1
        bounds = np.flatnonzero(np.r_[True, piece[1:] != piece[:-1]])
        for lo, hi in zip(bounds, np.r_[bounds[1:], len(piece)]):
            piece_blocks.append(block_id[lo:hi])
            piece_held.append(int(block_held[lo:hi].sum()))
            piece_seqs.append(block_seq[lo : lo + 1])
    if not piece_blocks:
        return
    piece_held = np.array(piece_held)
    piece_sharers = np.array([len(m) for m in piece_seqs])
    heads = np.arange(num_kv_heads)[None, :, None]
    for s in np.unique(piece_sharers):
        bucket = np.flatnonzero(piece_sharers == s)
        bucket = bucket[np.argsort(piece_held[bucket], kind="stable")]  # shortest first: little padding
        for lo in range(0, len(bucket), per_round):
            part = bucket[lo : lo + per_round]
            key_blocks = -(-int(piece_held[part].max()) // bs)
            blocks = np.full((len(part), key_blocks), chunks.scratch_block, dtype=np.int64)
            for i, p in enumerate(part):
                blocks[i, : len(piece_blocks[p])] = piece_blocks[p]
            slabs = chunks.pool_rows(blocks[:, None, :], heads, 0) // bs  # [pieces, kv_heads, blocks]
            key_len = key_blocks * bs
            mask = None
            if (piece_held[part] < key_len).any():
                mask = np.where(np.arange(key_len)[None, :] < piece_held[part][:, None], 0.0, -np.inf)
                mask = torch.from_numpy(mask.astype(np.float32)[:, None, None, :]).to(device)
            plan.decode_rounds.append(GatherRound(
                seqs=torch.from_numpy(np.stack([piece_seqs[p] for p in part])).to(device),
                slabs=torch.from_numpy(slabs.reshape(-1)).to(device),
                mask=mask,
                key_len=key_len,
            ))
