"""Paged attention, registered with transformers' ``AttentionInterface`` as
``"kvroute_paged"``.

One forward runs a flattened batch: several sequences' prefill chunks and
decode tokens, each token with its own position. The attention function
writes the step's new keys/values into their pool slots, then attends every
query over its own sequence's blocks. The per-step plan (index tensors built
once per step, shared by all layers) arrives as the ``kvroute_step`` keyword
argument, which transformers forwards from ``model(...)`` to attention.

Two kernels:

- default (:class:`DefaultPlan`, here): decodes batched into one SDPA call
  over gathered, padded contexts; each prefill chunk one SDPA call;
- batch-invariant (worker/tiled_attention.py): a query's output depends only
  on its own keys, never on the batch, the chunking or the tile it sits in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from worker.tiled_attention import TiledPlan, tiled_attention

if TYPE_CHECKING:
    from worker.step import ChunkArrays

ATTN_IMPLEMENTATION = "kvroute_paged"


@dataclass(slots=True)
class DefaultPlan:
    decode_rows: torch.Tensor | None  # [num_decodes] rows of one-token chunks
    decode_slabs: torch.Tensor | None  # [num_decodes, kv_heads, max_blocks] block slabs (scratch past the end)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] True where a key is visible
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (row, n, slabs [kv_heads, blocks], mask)


def build_default_plan(chunks: ChunkArrays, device: torch.device) -> DefaultPlan:
    bs, heads = chunks.block_size, np.arange(chunks.num_kv_heads)
    is_decode = chunks.lengths == 1
    decode = np.flatnonzero(is_decode)
    decode_rows = decode_slabs = decode_mask = None
    if len(decode):
        context = chunks.ends[decode]
        num_blocks = int(-(-context.max() // bs))
        block_pos = np.arange(num_blocks) * bs
        blocks = chunks.blocks(decode[:, None], block_pos[None, :])  # [B, nblk]
        slabs = chunks.slab_ids(blocks[:, None, :], heads[None, :, None], block_pos, bs)
        visible = np.arange(num_blocks * bs)[None, :] < context[:, None]
        decode_rows = torch.from_numpy(chunks.offsets[decode]).to(device)
        decode_slabs = torch.from_numpy(slabs).to(device)
        decode_mask = torch.from_numpy(visible[:, None, None, :]).to(device)
    prefills = []
    for index in np.flatnonzero(~is_decode):
        start, length = int(chunks.starts[index]), int(chunks.lengths[index])
        num_blocks = -(-(start + length) // bs)
        block_pos = np.arange(num_blocks) * bs
        blocks = chunks.blocks(np.int64(index), block_pos)
        slabs = torch.from_numpy(chunks.slab_ids(blocks[None, :], heads[:, None], block_pos, bs)).to(device)
        mask = None  # from position 0, top-left causal is exact (keys past the end come after every query)
        if start:
            query_pos = start + np.arange(length)
            mask = torch.from_numpy(np.arange(num_blocks * bs)[None, :] <= query_pos[:, None]).to(device)
        prefills.append((int(chunks.offsets[index]), length, slabs, mask))
    return DefaultPlan(decode_rows, decode_slabs, decode_mask, prefills)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query [1, heads, T, D]``, ``key``/``value``
    ``[1, kv_heads, T, D]`` → ``([1, T, heads, D], None)``."""
    step = kwargs.get("kvroute_step")
    if step is None:
        raise RuntimeError("kvroute_paged attention needs the kvroute_step keyword (run the model via worker.runner)")
    layer, pool = module.layer_idx, step.pool
    head_dim = query.shape[-1]
    # One write per (head, token); padding tokens all land in the scratch block.
    pool.rows(layer, 0).index_copy_(0, step.write_rows, key[0].reshape(-1, head_dim).to(pool.data.dtype))
    pool.rows(layer, 1).index_copy_(0, step.write_rows, value[0].reshape(-1, head_dim).to(pool.data.dtype))
    scale = scaling if scaling is not None else head_dim**-0.5
    if isinstance(step.plan, TiledPlan):
        out = tiled_attention(query[0], pool, layer, step.plan, scale)
    else:
        out = _default_attention(query[0], pool, layer, step.plan, scale)
    return out.unsqueeze(0), None


def _default_attention(q, pool, layer: int, plan: DefaultPlan, scale: float) -> torch.Tensor:
    """``q [heads, T, D]`` → ``[T, heads, D]``."""
    num_heads, num_rows, head_dim = q.shape
    bs = pool.block_size
    keys, values = pool.slabs(layer, 0, bs), pool.slabs(layer, 1, bs)  # [slabs, bs, D]
    out = q.new_empty(num_heads, num_rows, head_dim)
    if plan.decode_rows is not None:
        num_decodes, num_kv_heads, num_blocks = plan.decode_slabs.shape
        slabs = plan.decode_slabs.view(-1)
        k = keys.index_select(0, slabs).view(num_decodes, num_kv_heads, num_blocks * bs, head_dim)
        v = values.index_select(0, slabs).view(num_decodes, num_kv_heads, num_blocks * bs, head_dim)
        qd = q[:, plan.decode_rows].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True)
        out[:, plan.decode_rows] = o[:, :, 0].transpose(0, 1)
    for row, length, slabs, mask in plan.prefills:
        num_kv_heads, num_blocks = slabs.shape
        k = keys.index_select(0, slabs.view(-1)).view(1, num_kv_heads, num_blocks * bs, head_dim)
        v = values.index_select(0, slabs.view(-1)).view(1, num_kv_heads, num_blocks * bs, head_dim)
        qc = q[:, row : row + length].unsqueeze(0)  # [1, heads, n, D]
        o = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        out[:, row : row + length] = o[0]
    return out.transpose(0, 1)


def register() -> None:
    """Make ``"kvroute_paged"`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
