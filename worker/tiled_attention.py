"""Batch-invariant paged attention: a query's output depends only on its own
keys, never on the batch, the chunking, or where its tile sits.

Layout. Query rows are (token, query head) pairs; a *tile* holds rows of one
sequence that share one KV head (head-major: row ``(h * T + t) * group + r``
of the step's query matrix is token ``t``, query head ``h * group + r``).
Keys come in blocks of ``KEY_BLOCK`` (64) positions aligned to absolute
positions (block ``j`` holds positions ``[j * 64, (j + 1) * 64)``). A *pair*
is (tile, key block) for every key block up to the tile's last position.

Numerics. Per pair, the scores ``q·kᵀ`` and ``P·V`` are batched matmuls of a
fixed shape, so each row gets the same bits wherever it is computed; masked
scores become ``-inf`` before the exponent, so they contribute exact zeros.
A row's max over all its pairs is exact (max does not round); its
exponentials, fixed-length row sums and products are element-wise; the
pairs' results are added into the row in key-block order, one add per
element per block (tiles are numbered longest first, so a key block's
pairs add into one contiguous slice of the tiles' sums). Nothing depends on
how many pairs, tiles or sequences share the step.

Shared prefixes. Decode tiles that read the same key block (a cached
prefix several sequences hold) are stacked into one product per block of
up to 128 rows, the block gathered once, where :func:`choose_share_rows`
confirms at start-up that every such row count gives a row its own tile's
bits; elsewhere each pair gathers its own keys.

Tile shapes. DESIGN.md's recipe uses 16-row tiles and 32-key blocks; here
key blocks are 64 positions (fewer pairs, same argument), and where
:func:`tile_rows_are_exact` confirms at start-up that this BLAS gives a row
the same bits in a 4-, 16- or 128-row matmul (it does from 4 rows up on the
CPUs we measured; 1-3 rows take another kernel), prefill rows come in
128-row tiles and a decode token (``group`` rows) in a tile of
``max(group, 4)`` rows: fewer pairs for long prompts, no padding waste for
decodes. Where the probe fails, every tile has 16 rows. Measured on the bench model (2-core CPU, 512 new tokens over a
512-token cached context): 16-row tiles and 32-key blocks cost 2.3x the
default kernel's forward, 128-row tiles and 64-key blocks 1.2x. The key
block size changes which float sums are formed, so engine and reference
always share this module's constants.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
import numpy as np
import torch

from worker.chunk_arrays import ChunkArrays

TILE_ROWS = 16  # rows per tile when tile sizes may not be mixed (DESIGN.md's recipe)
PREFILL_TILE_ROWS = 128  # rows per prefill tile where mixing is exact
KEY_BLOCK = 64  # keys per pair
MIN_EXACT_ROWS = 4  # below this, matmuls switch kernels (measured)


@dataclass(slots=True)
class SharedKeys:
    """Pairs of a round that read the same key block (a cached prefix several decodes
    share), ``sharers`` at a time: each block is gathered once and its pairs' query
    rows are the rows of one product (``sharers * rows_per_tile`` rows)."""

    sharers: int
    pairs: torch.Tensor  # [units * sharers] pairs (counted from the round's lo), unit-major
    query_rows: torch.Tensor  # [units * sharers * rows_per_tile] their query rows
    slabs: torch.Tensor  # [units * slabs_per_pair] each unit's key slabs


@dataclass(slots=True)
class PairRound:
    """A run ``[lo, hi)`` of a tile group's pairs whose keys are gathered at once."""

    lo: int
    hi: int
    masked: torch.Tensor | None  # [M] pairs (counted from lo) with at least one invisible key; None: none
    mask: torch.Tensor | None  # [M, rows_per_tile, key_block] True where the key is not visible
    spans: list[tuple[int, int, int]]  # per key block in the round, in block order: (first pair - lo, tiles a..b)
    shared: list[SharedKeys] | None  # where pairs share key blocks: every pair, by sharer count; None: one per pair


@dataclass(slots=True)
class TileGroup:
    """Tiles of one shape, longest first, and their pairs in key-block-major order.

    Tiles are numbered by descending count of key blocks, so key block ``j``
    is read by tiles ``0 .. count_j - 1``: its pairs are one contiguous run
    and their results add into one contiguous slice of the tiles' sums."""

    rows_per_tile: int
    num_tiles: int
    tile_rows: torch.Tensor  # [num_tiles, rows_per_tile] query rows; pad_row for padding
    pair_tile: torch.Tensor  # [num_pairs] tile of each pair, key-block-major order
    pair_query_rows: torch.Tensor  # [num_pairs * rows_per_tile] = tile_rows[pair_tile]
    pair_slabs: torch.Tensor  # [num_pairs * slabs_per_pair] pool slabs holding each pair's keys
    rounds: list[PairRound]


@dataclass(slots=True)
class TiledPlan:
    key_block: int
    rows_per_slab: int  # min(block_size, key_block): the pool is read in slabs of this many rows
    pad_row: int  # the all-zero row appended to the query matrix
    groups: list[TileGroup]
    pairs_per_round: int  # pairs whose keys are gathered at once (scratch bound)

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool, layer: int, scale: float):
        """``q [heads, T, D]`` → ``[T, heads, D]``; every key is read from the pool (written already)."""
        return tiled_attention(q, pool, layer, self, scale)


def small_tile_rows(group: int) -> int:
    """Rows of a decode token's tile: all its query heads, at least 4, at most 16."""
    return min(TILE_ROWS, max(group, MIN_EXACT_ROWS))


@functools.lru_cache(maxsize=None)
def tile_rows_are_exact(row_counts: tuple[int, ...], head_dim: int, key_block: int, dtype, device) -> bool:
    """Do ``[rows, D] x [D, key_block]`` and ``[rows, key_block] x [key_block, D]``
    batched matmuls give each row the same bits for every row count in
    ``row_counts`` and any batch count?"""
    generator = torch.Generator(device="cpu").manual_seed(4321)
    most = max(row_counts)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k = rand(33, most, head_dim), rand(33, head_dim, key_block)
    p, v = rand(33, most, key_block), rand(33, key_block, head_dim)
    for lhs, rhs in ((q, k), (p, v)):
        full = torch.bmm(lhs, rhs)
        for rows in row_counts:
            for batch in (1, 5, 33):
                part = torch.bmm(lhs[:batch, :rows].contiguous(), rhs[:batch])
                if not torch.equal(part, full[:batch, :rows]):
                    return False
    return True


def choose_share_rows(decode_tile_rows: int, head_dim: int, dtype, device) -> int:
    """Most rows a product over one shared key block may have (decode tiles stacked):
    :data:`PREFILL_TILE_ROWS` where every multiple of ``decode_tile_rows`` up to it gives a
    row the same bits as its own tile does; else 0 (no sharing)."""
    counts = tuple(range(decode_tile_rows, PREFILL_TILE_ROWS + 1, decode_tile_rows))
    if decode_tile_rows >= MIN_EXACT_ROWS and tile_rows_are_exact(counts, head_dim, KEY_BLOCK, dtype, device):
        return PREFILL_TILE_ROWS
    return 0


def choose_tile_rows(group: int, head_dim: int, dtype, device) -> tuple[int, int]:
    """(decode tile rows, prefill tile rows): mixed sizes where exact, else 16 and 16."""
    decode = small_tile_rows(group)
    if tile_rows_are_exact((decode, TILE_ROWS, PREFILL_TILE_ROWS), head_dim, KEY_BLOCK, dtype, device):
        return decode, PREFILL_TILE_ROWS
    return TILE_ROWS, TILE_ROWS


def build_tiled_plan(
    chunks: ChunkArrays,
    num_rows: int,
    group: int,
    device: torch.device,
    *,
    decode_tile_rows: int = TILE_ROWS,
    prefill_tile_rows: int = TILE_ROWS,
    scratch_tokens: int = 32768,
    share_rows: int = 0,
) -> TiledPlan:
    """``num_rows``: tokens in the (padded) flattened batch; ``group``: query heads per
    KV head; tile rows for one-token chunks and for longer ones (see :func:`choose_tile_rows`);
    ``scratch_tokens``: key positions gathered at once (rounds of whole pairs);
    ``share_rows``: decode tiles reading the same key block are stacked into products of
    at most this many rows (:func:`choose_share_rows`; 0: none)."""
    rows_per_slab = min(chunks.block_size, KEY_BLOCK)
    pad_row = chunks.num_kv_heads * num_rows * group
    is_decode = chunks.lengths == 1
    classes = [(np.flatnonzero(is_decode), decode_tile_rows), (np.flatnonzero(~is_decode), prefill_tile_rows)]
    if decode_tile_rows == prefill_tile_rows:
        classes = [(np.arange(len(chunks.lengths)), prefill_tile_rows)]
    pairs_per_round = max(1, scratch_tokens * chunks.num_kv_heads // KEY_BLOCK)  # a pair: KEY_BLOCK positions of one head
    groups = [
        _build_group(chunks, members, rows, num_rows, group, rows_per_slab, pad_row, device, pairs_per_round,
                     max(1, share_rows // rows))
        for members, rows in classes
        if len(members)
    ]
    return TiledPlan(KEY_BLOCK, rows_per_slab, pad_row, groups, pairs_per_round)


def _build_group(
    chunks, members, rows_per_tile, num_rows, group, rows_per_slab, pad_row, device, pairs_per_round, max_sharers
) -> TileGroup:
    lengths, starts, offsets = chunks.lengths[members], chunks.starts[members], chunks.offsets[members]
    tiles_per_chunk = -(-lengths * group // rows_per_tile)
    num_chunk_tiles = int(tiles_per_chunk.sum())
    tile_member = np.repeat(np.arange(len(members)), tiles_per_chunk)
    tile_local = np.arange(num_chunk_tiles) - np.repeat(np.cumsum(tiles_per_chunk) - tiles_per_chunk, tiles_per_chunk)
    local_row = tile_local[:, None] * rows_per_tile + np.arange(rows_per_tile)  # [chunk tiles, rows]
    row_valid = local_row < (lengths * group)[tile_member][:, None]
    token = np.minimum(local_row // group, lengths[tile_member][:, None] - 1)
    row_pos = starts[tile_member][:, None] + token  # ascending; padding rows repeat the last token
    row_base = offsets[tile_member][:, None] * group + local_row
    blocks_per_tile = row_pos[:, -1] // KEY_BLOCK + 1

    # Every (KV head, chunk tile), longest first (stable). Head h's query rows start at h * num_rows * group.
    tile_head = np.repeat(np.arange(chunks.num_kv_heads), num_chunk_tiles)
    tile_of = np.tile(np.arange(num_chunk_tiles), chunks.num_kv_heads)  # chunk tile of each tile
    order = np.argsort(-blocks_per_tile[tile_of], kind="stable")
    tile_head, tile_of = tile_head[order], tile_of[order]
    tile_blocks = blocks_per_tile[tile_of]  # descending
    tile_rows = np.where(row_valid[tile_of], row_base[tile_of] + (tile_head * num_rows * group)[:, None], pad_row)
    num_tiles = len(tile_of)
    counts = num_tiles - np.cumsum(np.bincount(tile_blocks, minlength=int(tile_blocks[0]) + 1))[:-1]  # [key blocks]
    firsts = np.cumsum(counts) - counts
    pair_block = np.repeat(np.arange(len(counts)), counts)
    pair_tile = np.arange(len(pair_block)) - np.repeat(firsts, counts)
    pair_of = tile_of[pair_tile]
    slab_pos = pair_block[:, None] * KEY_BLOCK + np.arange(0, KEY_BLOCK, rows_per_slab)  # [pairs, slabs]
    slab_blocks = chunks.blocks(members[tile_member[pair_of]][:, None], slab_pos)
    slabs = chunks.slab_ids(slab_blocks, tile_head[pair_tile][:, None], slab_pos, rows_per_slab)
    needs_mask = pair_block * KEY_BLOCK + KEY_BLOCK - 1 > row_pos[pair_of, 0]  # some key past the tile's first row

    rounds = []
    for lo in range(0, len(pair_block), pairs_per_round):
        hi = min(len(pair_block), lo + pairs_per_round)
        masked = np.flatnonzero(needs_mask[lo:hi])
        mask = None
        if len(masked):
            key_pos = pair_block[lo + masked][:, None] * KEY_BLOCK + np.arange(KEY_BLOCK)
            mask = torch.from_numpy(key_pos[:, None, :] > row_pos[pair_of[lo + masked]][:, :, None]).to(device)
        spans = []
        for j in range(int(pair_block[lo]), int(pair_block[hi - 1]) + 1):
            a, b = max(int(firsts[j]), lo), min(int(firsts[j] + counts[j]), hi)
            spans.append((a - lo, a - int(firsts[j]), b - int(firsts[j])))
        shared = _shared_keys(slabs[lo:hi], tile_rows[pair_tile[lo:hi]], max_sharers, device)
        rounds.append(PairRound(
            lo, hi, torch.from_numpy(masked).to(device) if len(masked) else None, mask, spans, shared,
        ))
    return TileGroup(
        rows_per_tile=rows_per_tile,
        num_tiles=num_tiles,
        tile_rows=torch.from_numpy(tile_rows).to(device),
        pair_tile=torch.from_numpy(pair_tile).to(device),
        pair_query_rows=torch.from_numpy(tile_rows[pair_tile].reshape(-1)).to(device),
        pair_slabs=torch.from_numpy(slabs.reshape(-1)).to(device),
        rounds=rounds,
    )


def _shared_keys(slabs: np.ndarray, query_rows: np.ndarray, max_sharers: int, device) -> list[SharedKeys] | None:
    """A round's pairs (``slabs [n, slabs_per_pair]``, ``query_rows [n, rows]``) grouped by
    the key block they read, at most ``max_sharers`` to a unit, units bucketed by size;
    None where no two pairs share a block (or sharing is off)."""
    if max_sharers <= 1 or len(slabs) < 2:
        return None
    rows_as_keys = np.ascontiguousarray(slabs).view(np.dtype((np.void, slabs.dtype.itemsize * slabs.shape[1])))
    _, unit = np.unique(rows_as_keys.reshape(-1), return_inverse=True)  # same slabs, same unit
    unit = unit.reshape(-1)
    order = np.argsort(unit, kind="stable")
    first_of_unit = np.searchsorted(unit[order], unit[order])
    piece = np.empty_like(unit)
    piece[order] = (np.arange(len(unit)) - first_of_unit) // max_sharers  # k-th max_sharers of its unit
    _, unit = np.unique(unit * len(unit) + piece, return_inverse=True)  # units of at most max_sharers pairs
    unit = unit.reshape(-1)
    sizes = np.bincount(unit)
    if sizes.max() == 1:
        return None
    order = np.argsort(unit, kind="stable")  # unit-major
    pair_size = sizes[unit[order]]
    buckets = []
    for sharers in np.unique(sizes):
        pairs = order[pair_size == sharers]  # [units * sharers], unit-major
        reps = pairs[::sharers]
        buckets.append(SharedKeys(
            sharers=int(sharers),
            pairs=torch.from_numpy(pairs).to(device),
            query_rows=torch.from_numpy(query_rows[pairs].reshape(-1)).to(device),
            slabs=torch.from_numpy(slabs[reps].reshape(-1)).to(device),
        ))
    return buckets


def tiled_attention(q: torch.Tensor, pool, layer: int, plan: TiledPlan, scale: float) -> torch.Tensor:
    """``q [heads, T, D]`` → ``[T, heads, D]``."""
    num_heads, num_rows, head_dim = q.shape
    num_kv_heads = pool.geometry.num_kv_heads
    group = num_heads // num_kv_heads
    q_rows = (q * scale).view(num_kv_heads, group, num_rows, head_dim).transpose(1, 2).reshape(-1, head_dim)
    q_rows = torch.cat([q_rows, q_rows.new_zeros(1, head_dim)])  # the padding row
    keys = pool.slabs(layer, 0, plan.rows_per_slab)
    values = pool.slabs(layer, 1, plan.rows_per_slab)
    out_rows = q_rows.new_zeros(q_rows.shape[0], head_dim)
    for tiles in plan.groups:
        tile_out = _attend(q_rows, keys, values, tiles, plan.key_block)
        out_rows.index_copy_(0, tiles.tile_rows.view(-1), tile_out.view(-1, head_dim))
    out = out_rows[:-1].view(num_kv_heads, num_rows, group, head_dim).permute(1, 0, 2, 3)
    return out.reshape(num_rows, num_heads, head_dim)


def _attend(q_rows, keys, values, tiles: TileGroup, key_block: int) -> torch.Tensor:
    """One tile group → ``[tiles, rows, D]``, its pairs in the plan's rounds.

    A first pass takes each row's exact max over every round (max does not
    round); the second recomputes each round's scores (kept from the first
    pass when there is one round) and adds its pairs in, key block by key
    block, each block's pairs into a contiguous slice of tiles: a row gets
    one add per key block in block order, so the bits do not depend on the
    rounds or on which other tiles share the step."""
    rows, head_dim = tiles.rows_per_tile, q_rows.shape[1]
    slabs_per_pair = tiles.pair_slabs.shape[0] // tiles.pair_tile.shape[0]

    def scores_of(work: PairRound) -> torch.Tensor:
        lo, hi = work.lo, work.hi
        if work.shared is None:
            qp = q_rows.index_select(0, tiles.pair_query_rows[lo * rows : hi * rows]).view(hi - lo, rows, head_dim)
            kp = keys.index_select(0, tiles.pair_slabs[lo * slabs_per_pair : hi * slabs_per_pair])
            scores = torch.bmm(qp, kp.view(hi - lo, key_block, head_dim).transpose(1, 2))  # [P, rows, key_block]
        else:  # each shared key block once, its pairs' rows stacked (same bits: choose_share_rows)
            scores = q_rows.new_empty(hi - lo, rows, key_block)
            for part in work.shared:
                units = part.pairs.shape[0] // part.sharers
                qp = q_rows.index_select(0, part.query_rows).view(units, part.sharers * rows, head_dim)
                kp = keys.index_select(0, part.slabs).view(units, key_block, head_dim)
                scores.index_copy_(0, part.pairs, torch.bmm(qp, kp.transpose(1, 2)).view(-1, rows, key_block))
        if work.masked is not None:  # only pairs that hold an invisible key
            hidden = scores.index_select(0, work.masked).masked_fill_(work.mask, float("-inf"))
            scores.index_copy_(0, work.masked, hidden)
        return scores

    row_max = q_rows.new_full((tiles.num_tiles, rows), float("-inf"))
    kept = None
    for work in tiles.rounds:
        scores = scores_of(work)
        pair_max = scores.amax(dim=-1)  # [P, rows]
        for first, a, b in work.spans:
            torch.maximum(row_max[a:b], pair_max[first : first + b - a], out=row_max[a:b])  # exact
        kept = scores if len(tiles.rounds) == 1 else None
    total = q_rows.new_zeros(tiles.num_tiles, rows, head_dim)
    denom = q_rows.new_zeros(tiles.num_tiles, rows)
    for work in tiles.rounds:
        lo, hi = work.lo, work.hi
        scores = kept if kept is not None else scores_of(work)
        scores.sub_(row_max.index_select(0, tiles.pair_tile[lo:hi]).unsqueeze(-1)).exp_()  # masked: exp(-inf) = 0
        sums = scores.sum(dim=-1)  # [P, rows], fixed length key_block
        if work.shared is None:
            vp = values.index_select(0, tiles.pair_slabs[lo * slabs_per_pair : hi * slabs_per_pair])
            partial = torch.bmm(scores, vp.view(hi - lo, key_block, head_dim))  # [P, rows, D]
        else:
            partial = q_rows.new_empty(hi - lo, rows, head_dim)
            for part in work.shared:
                units = part.pairs.shape[0] // part.sharers
                pp = scores.index_select(0, part.pairs).view(units, part.sharers * rows, key_block)
                vp = values.index_select(0, part.slabs).view(units, key_block, head_dim)
                partial.index_copy_(0, part.pairs, torch.bmm(pp, vp).view(-1, rows, head_dim))
        for first, a, b in work.spans:  # key block 0, 1, 2, ...: one add per element each
            total[a:b].add_(partial[first : first + b - a])
            denom[a:b].add_(sums[first : first + b - a])
    return total / denom.unsqueeze(-1)
