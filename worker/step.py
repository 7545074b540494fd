"""One forward step's inputs: the flattened batch and its attention metadata.

The scheduler describes a step as :class:`SeqChunk` records (one per
sequence: the tokens it feeds, where they start, its block table);
:func:`build_step` turns them into tensors. Model code only sees
``input_ids`` and ``position_ids``; everything paged travels in the
:class:`StepBatch` handed to the attention function.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.attention import DEFAULT_SCRATCH_TOKENS, DefaultPlan, build_default_plan
from worker.chunk_arrays import ChunkArrays
from worker.gpu_attention import FlashInferPlan, build_flashinfer_plan
from worker.kv import KVPool
from worker.native import max_members_for
from worker.native_plan import NativePlan, build_native_plan
from worker.numerics import pad_rows
from worker.tiled_attention import TiledPlan, build_tiled_plan


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """A sequence's share of one step: feed ``token_ids`` at positions
    ``start_pos ..``; ``block_table`` covers every position up to the last fed
    one; ``needs_logits``: return the logits after the last fed token."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    needs_logits: bool


@dataclass(slots=True)
class StepBatch:
    pool: KVPool
    input_ids: torch.Tensor  # [num_rows] (padded with pad tokens in deterministic mode)
    position_ids: torch.Tensor  # [num_rows]
    write_rows: torch.Tensor  # [kv_heads * num_rows] pool row of each (head, token)'s K/V, head-major
    logits_rows: torch.Tensor  # [num_logits] rows whose logits are wanted, in chunk order
    plan: DefaultPlan | TiledPlan | FlashInferPlan | NativePlan  # attends the step's queries: plan.attend(q, key, value, pool, layer, scale)
    num_tokens: int  # real (unpadded) rows


def build_step(
    chunks: Sequence[SeqChunk],
    pool: KVPool,
    *,
    deterministic: bool,
    pad_token_id: int,
    num_heads: int,
    tile_rows: tuple[int, int] = (16, 16),
    scratch_tokens: int = DEFAULT_SCRATCH_TOKENS,
    flashinfer: bool = False,
    share_rows: int = 0,
    native: bool = False,
) -> StepBatch:
    """``tile_rows``: (decode, prefill) tile rows of the batch-invariant kernel;
    ``scratch_tokens``: K/V positions the default kernel gathers at once;
    ``flashinfer``: default mode plans for FlashInfer's paged kernel (CUDA);
    ``share_rows``: the batch-invariant kernel's shared-key products' row limit (0: no sharing);
    ``native``: every token runs the native kernel (worker/native/, worker/native_plan.py; batch-invariant,
    so in either mode)."""
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    device = pool.data.device
    lengths = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
    if (lengths < 1).any():
        raise ValueError("every chunk feeds at least one token")
    starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.cumsum(lengths) - lengths
    num_tokens = int(lengths.sum())
    num_rows = pad_rows(num_tokens) if deterministic else num_tokens
    table_lengths = np.fromiter((len(c.block_table) for c in chunks), dtype=np.int64, count=len(chunks))
    short = np.flatnonzero(table_lengths * pool.block_size < starts + lengths)
    if len(short):
        index = int(short[0])
        raise ValueError(f"chunk {index}: block table too short for position {starts[index] + lengths[index] - 1}")
    # [num_chunks, max_blocks], padded with the scratch block: one flat copy, not one per chunk
    tables = np.full((len(chunks), int(table_lengths.max())), pool.scratch_block_id, dtype=np.int64)
    tables[np.arange(tables.shape[1])[None, :] < table_lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(c.block_table for c in chunks), dtype=np.int64, count=int(table_lengths.sum())
    )
    num_kv_heads = pool.geometry.num_kv_heads
    arrays = ChunkArrays(offsets, lengths, starts, tables, pool.block_size, pool.scratch_block_id, num_kv_heads)

    token_chunk = np.repeat(np.arange(len(chunks)), lengths)
    positions = starts[token_chunk] + np.arange(num_tokens) - offsets[token_chunk]
    input_ids = np.full(num_rows, pad_token_id, dtype=np.int64)
    input_ids[:num_tokens] = np.fromiter(
        (t for c in chunks for t in c.token_ids), dtype=np.int64, count=num_tokens
    )
    position_ids = np.zeros(num_rows, dtype=np.int64)
    position_ids[:num_tokens] = positions
    token_blocks = np.full(num_rows, pool.scratch_block_id, dtype=np.int64)
    token_blocks[:num_tokens] = arrays.blocks(token_chunk, positions)
    heads = np.arange(num_kv_heads)[:, None]
    write_rows = arrays.pool_rows(token_blocks[None], heads, position_ids[None] % pool.block_size)
    write_rows[:, num_tokens:] = arrays.pool_rows(pool.scratch_block_id, heads, 0)  # padding: scratch
    wants = np.fromiter((c.needs_logits for c in chunks), dtype=bool, count=len(chunks))
    logits_rows = (offsets + lengths - 1)[wants]

    if native:
        plan = build_native_plan(arrays, max_members_for(num_heads, num_kv_heads), device)
    elif deterministic:
        plan = build_tiled_plan(
            arrays, num_rows, num_heads // num_kv_heads, device,
            decode_tile_rows=tile_rows[0], prefill_tile_rows=tile_rows[1], scratch_tokens=scratch_tokens,
            share_rows=share_rows,
        )
    elif flashinfer:
        plan = build_flashinfer_plan(arrays, num_heads, pool.geometry.head_dim, pool.data.dtype, device)
    else:
        plan = build_default_plan(arrays, device, scratch_tokens)
    return StepBatch(
        pool=pool,
        input_ids=torch.from_numpy(input_ids).to(device),
        position_ids=torch.from_numpy(position_ids).to(device),
        write_rows=torch.from_numpy(write_rows.reshape(-1)).to(device),
        logits_rows=torch.from_numpy(logits_rows).to(device),
        plan=plan,
        num_tokens=num_tokens,
    )
