"""Paged attention, registered with transformers' ``AttentionInterface`` as
``"kvroute_paged"``.

One forward runs a flattened batch: several sequences' prefill chunks and
decode tokens, each token with its own position. The attention function
writes the step's new keys/values into their pool slots, then attends every
query over its own sequence's blocks. The per-step plan (index tensors built
once per step, shared by all layers) arrives as the ``kvroute_step`` keyword
argument, which transformers forwards from ``model(...)`` to attention.

Two kernels:

- default (:class:`DefaultPlan`): decodes batched into one SDPA call over
  gathered, padded contexts; each prefill chunk one SDPA call;
- batch-invariant (:class:`TiledPlan`): queries in 16-row tiles (rows are
  (token, query-head) pairs sharing one KV head, one sequence per tile),
  keys in 32-position blocks aligned to absolute positions. Per
  (tile, key block) pair, scores, masked exp, row sums and P·V have fixed
  shapes; the row max is exact; block results are summed sequentially in
  block order. A query's output therefore depends only on its own keys,
  never on the batch, the chunking or where the tile sits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker.numerics import TILE_ROWS

ATTN_IMPLEMENTATION = "kvroute_paged"
KEY_BLOCK = 32  # keys per block of the batch-invariant kernel


@dataclass(frozen=True, slots=True)
class ChunkArrays:
    """The step's chunks as arrays (one entry per chunk)."""

    offsets: np.ndarray  # first row of the chunk in the flattened batch
    lengths: np.ndarray  # tokens fed this step
    starts: np.ndarray  # absolute position of the first fed token
    tables: np.ndarray  # [num_chunks, max_blocks] block tables, padded with the scratch block
    block_size: int
    scratch_slot: int

    def slots(self, chunk: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Pool slots of ``positions`` (same shape) in chunk ``chunk``'s table."""
        block_index = np.minimum(positions // self.block_size, self.tables.shape[1] - 1)
        return self.tables[chunk, block_index] * self.block_size + positions % self.block_size


@dataclass(slots=True)
class DefaultPlan:
    decode_rows: torch.Tensor | None  # [num_decodes] rows of one-token chunks
    decode_slots: torch.Tensor | None  # [num_decodes, max_len] context slots (scratch past the end)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] True where a key is visible
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (row, n, slots [ctx], mask [n, ctx])


@dataclass(slots=True)
class TiledPlan:
    num_tiles: int
    tile_rows: torch.Tensor  # [num_tiles, 16] rows of the head-major query matrix; pad_row for padding
    pad_row: int
    pair_tile: torch.Tensor  # [num_pairs] tile of each (tile, key block) pair, block-major order
    pair_query_rows: torch.Tensor  # [num_pairs, 16]
    pair_key_rows: torch.Tensor  # [num_pairs, 32] rows of the [slots * kv_heads, head_dim] pool view
    pair_masked: torch.Tensor  # [num_pairs, 16, 32] True where the key is NOT visible
    block_steps: list[tuple[int, int, torch.Tensor]]  # per key block j: pair range and its tiles


def build_default_plan(chunks: ChunkArrays, device: torch.device) -> DefaultPlan:
    is_decode = chunks.lengths == 1
    decode = np.flatnonzero(is_decode)
    decode_rows = decode_slots = decode_mask = None
    if len(decode):
        context = chunks.starts[decode] + 1
        max_len = int(context.max())
        positions = np.broadcast_to(np.arange(max_len), (len(decode), max_len))
        visible = positions < context[:, None]
        slots = np.where(visible, chunks.slots(decode[:, None], positions), chunks.scratch_slot)
        decode_rows = torch.from_numpy(chunks.offsets[decode]).to(device)
        decode_slots = torch.from_numpy(slots).to(device)
        decode_mask = torch.from_numpy(visible[:, None, None, :]).to(device)
    prefills = []
    for index in np.flatnonzero(~is_decode):
        start, length = int(chunks.starts[index]), int(chunks.lengths[index])
        context = np.arange(start + length)
        slots = torch.from_numpy(chunks.slots(np.int64(index), context)).to(device)
        mask = None
        if start:
            query_pos = start + np.arange(length)
            mask = torch.from_numpy(context[None, :] <= query_pos[:, None]).to(device)
        prefills.append((int(chunks.offsets[index]), length, slots, mask))
    return DefaultPlan(decode_rows, decode_slots, decode_mask, prefills)


def build_tiled_plan(chunks: ChunkArrays, num_rows: int, num_kv_heads: int, group: int, device: torch.device) -> TiledPlan:
    """``num_rows``: tokens in the (padded) flattened batch; ``group``: query heads per KV head."""
    tiles_per_chunk = -(-chunks.lengths * group // TILE_ROWS)
    num_chunk_tiles = int(tiles_per_chunk.sum())
    tile_chunk = np.repeat(np.arange(len(chunks.lengths)), tiles_per_chunk)
    tile_local = np.arange(num_chunk_tiles) - np.repeat(np.cumsum(tiles_per_chunk) - tiles_per_chunk, tiles_per_chunk)
    local_row = tile_local[:, None] * TILE_ROWS + np.arange(TILE_ROWS)  # [tiles, 16]
    row_valid = local_row < (chunks.lengths * group)[tile_chunk][:, None]
    token = np.minimum(local_row // group, chunks.lengths[tile_chunk][:, None] - 1)
    row_pos = chunks.starts[tile_chunk][:, None] + token  # padding rows repeat the last token
    row_base = chunks.offsets[tile_chunk][:, None] * group + local_row
    blocks_per_tile = row_pos.max(axis=1) // KEY_BLOCK + 1
    pair_tile = np.repeat(np.arange(num_chunk_tiles), blocks_per_tile)
    pair_block = np.arange(len(pair_tile)) - np.repeat(np.cumsum(blocks_per_tile) - blocks_per_tile, blocks_per_tile)
    key_pos = pair_block[:, None] * KEY_BLOCK + np.arange(KEY_BLOCK)  # [pairs, 32]
    pair_chunk = tile_chunk[pair_tile]
    key_valid = key_pos < (chunks.starts + chunks.lengths)[pair_chunk][:, None]
    slots = np.where(key_valid, chunks.slots(pair_chunk[:, None], key_pos), chunks.scratch_slot)
    masked = key_pos[:, None, :] > row_pos[pair_tile][:, :, None]  # [pairs, 16, 32]

    # Replicate per KV head: head h's query rows start at h * num_rows * group.
    pad_row = num_kv_heads * num_rows * group
    heads = np.arange(num_kv_heads)
    tile_rows = np.where(row_valid[None], row_base[None] + heads[:, None, None] * num_rows * group, pad_row)
    tile_rows = tile_rows.reshape(-1, TILE_ROWS)
    all_pair_tile = (pair_tile[None] + heads[:, None] * num_chunk_tiles).reshape(-1)
    all_pair_block = np.tile(pair_block, num_kv_heads)
    key_rows = (slots[None] * num_kv_heads + heads[:, None, None]).reshape(-1, KEY_BLOCK)
    order = np.argsort(all_pair_block, kind="stable")  # block-major: sequential accumulation per block
    all_pair_tile, all_pair_block, key_rows = all_pair_tile[order], all_pair_block[order], key_rows[order]
    masked = np.tile(masked, (num_kv_heads, 1, 1))[order]
    bounds = np.searchsorted(all_pair_block, np.arange(all_pair_block[-1] + 2))
    pair_tile_t = torch.from_numpy(all_pair_tile).to(device)
    block_steps = [
        (int(lo), int(hi), pair_tile_t[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo
    ]
    tile_rows_t = torch.from_numpy(tile_rows).to(device)
    return TiledPlan(
        num_tiles=num_kv_heads * num_chunk_tiles,
        tile_rows=tile_rows_t,
        pad_row=pad_row,
        pair_tile=pair_tile_t,
        pair_query_rows=tile_rows_t[pair_tile_t],
        pair_key_rows=torch.from_numpy(key_rows).to(device),
        pair_masked=torch.from_numpy(masked).to(device),
        block_steps=block_steps,
    )


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query [1, heads, T, D]``, ``key``/``value``
    ``[1, kv_heads, T, D]`` → ``([1, T, heads, D], None)``."""
    step = kwargs.get("kvroute_step")
    if step is None:
        raise RuntimeError("kvroute_paged attention needs the kvroute_step keyword (run the model via worker.runner)")
    layer = module.layer_idx
    pool = step.pool
    keys, values = pool.keys(layer), pool.values(layer)
    # [T, kv_heads, D]; one write per token (padding tokens all land in the scratch slot)
    keys.index_copy_(0, step.slot_mapping, key[0].transpose(0, 1).to(keys.dtype))
    values.index_copy_(0, step.slot_mapping, value[0].transpose(0, 1).to(values.dtype))
    q = query[0].transpose(0, 1)  # [T, heads, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if isinstance(step.plan, TiledPlan):
        out = _tiled_attention(q, keys, values, step.plan, scale)
    else:
        out = _default_attention(q, keys, values, step.plan, scale)
    return out.unsqueeze(0), None


def _default_attention(q, keys, values, plan: DefaultPlan, scale: float) -> torch.Tensor:
    out = torch.zeros_like(q)
    if plan.decode_rows is not None:
        k = keys[plan.decode_slots].transpose(1, 2)  # [B, kv_heads, L, D]
        v = values[plan.decode_slots].transpose(1, 2)
        qd = q[plan.decode_rows].unsqueeze(2)  # [B, heads, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True)
        out[plan.decode_rows] = o.squeeze(2)
    for row, length, slots, mask in plan.prefills:
        k = keys[slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, D]
        v = values[slots].transpose(0, 1).unsqueeze(0)
        qc = q[row : row + length].transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
        o = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        out[row : row + length] = o[0].transpose(0, 1)
    return out


def _tiled_attention(q, keys, values, plan: TiledPlan, scale: float) -> torch.Tensor:
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    # Head-major query rows: row (h * T + t) * group + r is token t, query head h * group + r.
    q_rows = q.reshape(num_rows, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, head_dim)
    q_rows = torch.cat([q_rows, q_rows.new_zeros(1, head_dim)])  # the padding row
    key_rows, value_rows = keys.view(-1, head_dim), values.view(-1, head_dim)
    qp = q_rows[plan.pair_query_rows]  # [P, 16, D]
    kp = key_rows[plan.pair_key_rows]  # [P, 32, D]
    vp = value_rows[plan.pair_key_rows]
    scores = torch.bmm(qp, kp.transpose(1, 2)) * scale  # [P, 16, 32]
    scores.masked_fill_(plan.pair_masked, float("-inf"))
    row_max = torch.full((plan.num_tiles, TILE_ROWS), float("-inf"), dtype=scores.dtype, device=scores.device)
    pair_max = scores.amax(dim=-1)  # [P, 16]
    row_max.scatter_reduce_(0, plan.pair_tile[:, None].expand_as(pair_max), pair_max, "amax")  # exact, order-free
    probs = torch.exp(scores - row_max[plan.pair_tile].unsqueeze(-1))  # masked -> exp(-inf) = 0
    sums = probs.sum(dim=-1)  # [P, 16], fixed length 32
    partial = torch.bmm(probs, vp)  # [P, 16, D]
    total = partial.new_zeros(plan.num_tiles, TILE_ROWS, head_dim)
    denom = sums.new_zeros(plan.num_tiles, TILE_ROWS)
    for lo, hi, tiles in plan.block_steps:  # key block 0, 1, 2, ...: one add per element each
        total.index_add_(0, tiles, partial[lo:hi])
        denom.index_add_(0, tiles, sums[lo:hi])
    tile_out = total / denom.unsqueeze(-1)
    out_rows = q_rows.new_zeros(q_rows.shape[0], head_dim)
    out_rows[plan.tile_rows.reshape(-1)] = tile_out.reshape(-1, head_dim)
    out = out_rows[:-1].view(num_kv_heads, num_rows, group, head_dim).transpose(0, 1)
    return out.reshape(num_rows, num_heads, head_dim)


def register() -> None:
    """Make ``"kvroute_paged"`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
