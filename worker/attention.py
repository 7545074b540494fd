"""Paged attention, registered with transformers' ``AttentionInterface`` as
``"kvroute_paged"``, and its default kernel.

One forward runs a flattened batch: several sequences' prefill chunks and
decode tokens, each token with its own position. The attention function
writes the step's new keys/values into their pool slots, then hands the
queries to the step's plan (``plan.attend``), built once per step and shared
by all layers; it arrives as the ``kvroute_step`` keyword argument, which
transformers forwards from ``model(...)`` to attention. Plans: the default
one here, the batch-invariant one (worker/tiled_attention.py), a GPU one
(worker/gpu_attention.py).

Default kernel: K/V are read from the pool by block table, in *rounds* that
each gather at most ``scratch_tokens`` positions, so attention's scratch
memory is set by config, not by batch × context.

- Decode tokens are batched across sequences without padding to the
  longest: each sequence's context is cut into key chunks of
  :data:`DECODE_KEY_CHUNK` positions aligned to absolute positions (whole
  blocks); a *pair* is (sequence, key chunk). A full chunk whose blocks
  several decodes share (a cached prefix) is gathered once and attended by
  all of them together (their query heads as rows of one query). A round
  attends a run of chunks (one fused attention call returning each row's
  log-sum-exp); the rounds' results are merged into the sequences' outputs
  once per layer (online softmax; in batches where they would exceed the
  scratch bound). Only a sequence's last chunk is masked, and it reads only
  the blocks the longest last chunk of its round needs.
- A prefill chunk attends to its own new keys straight from the step's
  ``key``/``value`` (causal, no copy) and to its cached prefix gathered from
  the pool in rounds (nothing masked), merged the same way.

Merging partial results by log-sum-exp is exact up to float rounding; the
order of rounds depends on the batch, so this kernel is not batch-invariant
(deterministic mode uses the tiled kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.chunk_arrays import ChunkArrays

ATTN_IMPLEMENTATION = "kvroute_paged"
DECODE_KEY_CHUNK = 128  # positions per decode pair (rounded up to whole blocks)
DEFAULT_SCRATCH_TOKENS = 32768  # K/V positions one round may gather
_MATH_SCORES = 1 << 24  # score elements the plain-maths fallback holds at once
_EMPTY_LSE = -1e30  # a running log-sum-exp before any key (finite: exp(-1e30 - m) == 0, never NaN)


@dataclass(slots=True)
class DecodeRound:
    """Key chunks that the same number of decodes read: ``seqs[u]`` are the decodes
    (indices among the step's decodes) attending chunk ``u``; more than one where
    sequences share the chunk's blocks (a cached prefix), then it is gathered once."""

    seqs: torch.Tensor  # [chunks, sharers]
    slabs: torch.Tensor  # [chunks * kv_heads * slabs_per_chunk] block slabs of each chunk's keys
    mask: torch.Tensor | None  # [chunks, 1, 1, key_len] 0 where visible, -inf past the end; None: all visible
    key_len: int  # positions read per chunk: the key chunk, or (last chunks) the longest one's blocks


@dataclass(slots=True)
class PrefillWork:
    row: int  # first row of the chunk in the flattened batch
    length: int
    past_rounds: list[torch.Tensor]  # each [kv_heads * n] pool rows of n cached positions, head-major


@dataclass(slots=True)
class DefaultPlan:
    decode_rows: torch.Tensor | None  # [num_decodes] rows of one-token chunks
    key_chunk: int  # positions per decode pair
    decode_rounds: list[DecodeRound]
    prefills: list[PrefillWork]
    merge_pairs: int = 1  # decode partial results held before they are merged (all rounds' at once when they fit)

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool, layer: int, scale: float):
        """``q [heads, T, D]``, this step's ``key``/``value [kv_heads, T, D]`` → ``[T, heads, D]``."""
        return _default_attention(q, key, value, pool, layer, self, scale)


def build_default_plan(
    chunks: ChunkArrays, device: torch.device, scratch_tokens: int = DEFAULT_SCRATCH_TOKENS
) -> DefaultPlan:
    """``scratch_tokens``: most K/V positions gathered at once (at least one key chunk)."""
    bs, num_kv_heads = chunks.block_size, chunks.num_kv_heads
    key_chunk = -(-DECODE_KEY_CHUNK // bs) * bs
    is_decode = chunks.lengths == 1
    decode = np.flatnonzero(is_decode)
    decode_rows, rounds = None, []
    if len(decode):
        decode_rows = torch.from_numpy(chunks.offsets[decode]).to(device)
        rounds = _decode_rounds(chunks, decode, key_chunk, scratch_tokens, device)
    prefills = []
    heads = np.arange(num_kv_heads)[:, None]
    for index in np.flatnonzero(~is_decode):
        start = int(chunks.starts[index])
        past_rounds = []
        for lo in range(0, start, max(bs, scratch_tokens)):
            positions = np.arange(lo, min(start, lo + max(bs, scratch_tokens)))
            blocks = chunks.tables[index, positions // bs]
            rows = chunks.pool_rows(blocks[None, :], heads, positions[None, :] % bs)  # [kv_heads, n]
            past_rounds.append(torch.from_numpy(rows.reshape(-1)).to(device))
        prefills.append(PrefillWork(int(chunks.offsets[index]), int(chunks.lengths[index]), past_rounds))
    merge_pairs = max(len(decode), scratch_tokens // key_chunk)
    return DefaultPlan(decode_rows, key_chunk, rounds, prefills, merge_pairs)


def _decode_rounds(chunks: ChunkArrays, decode: np.ndarray, key_chunk: int, scratch_tokens: int, device) -> list:
    """Pairs (decode, key chunk) → rounds. Full chunks with the same blocks are read once for
    all their decodes; chunks are bucketed by how many decodes read them (one call each)."""
    bs, num_kv_heads = chunks.block_size, chunks.num_kv_heads
    ends = chunks.ends[decode]
    chunks_per_seq = -(-ends // key_chunk)
    pair_seq = np.repeat(np.arange(len(decode)), chunks_per_seq)  # [pairs]
    pair_start = np.arange(len(pair_seq)) - np.repeat(np.cumsum(chunks_per_seq) - chunks_per_seq, chunks_per_seq)
    pair_start *= key_chunk
    slab_pos = pair_start[:, None] + np.arange(0, key_chunk, bs)  # [pairs, slabs_per_chunk]
    blocks = chunks.blocks(decode[pair_seq][:, None], slab_pos)
    is_full = pair_start + key_chunk <= ends[pair_seq]
    # One unit per distinct full chunk (by its blocks), one per partial pair.
    full = np.flatnonzero(is_full)
    _, first, unit_of_full = np.unique(blocks[full], axis=0, return_index=True, return_inverse=True)
    unit = np.empty(len(pair_seq), dtype=np.int64)
    unit[full] = unit_of_full.reshape(-1)
    partial = np.flatnonzero(~is_full)
    unit[partial] = len(first) + np.arange(len(partial))
    unit_pair = np.concatenate([full[first], partial])  # a representative pair per unit
    order = np.argsort(unit, kind="stable")
    sharers = np.bincount(unit, minlength=len(unit_pair))
    members = np.split(pair_seq[order], np.cumsum(sharers)[:-1])  # decodes reading each unit
    heads = np.arange(num_kv_heads)[None, :, None]
    valid = np.minimum(ends[pair_seq[unit_pair]] - pair_start[unit_pair], key_chunk)  # positions of each unit
    rounds = []
    # Full chunks by number of sharers; then the partial (last) chunks, shortest first, each round
    # reading only the blocks its longest one needs: at most a block per sequence read in vain.
    buckets = [np.flatnonzero((sharers == count) & is_full[unit_pair]) for count in np.unique(sharers)]
    partial_units = np.flatnonzero(~is_full[unit_pair])
    buckets.append(partial_units[np.argsort(valid[partial_units], kind="stable")])
    per_round = max(1, scratch_tokens // key_chunk)
    for units in buckets:
        for lo in range(0, len(units), per_round):
            part = units[lo : lo + per_round]
            if not len(part):
                continue
            rep = unit_pair[part]
            key_len = key_chunk if is_full[rep].all() else -(-int(valid[part].max()) // bs) * bs
            seqs = np.stack([members[u] for u in part])  # [units, sharers]
            first_pos = pair_start[rep][:, None, None] + np.arange(0, key_len, bs)  # [units, 1, slabs]
            slabs = chunks.slab_ids(blocks[rep][:, None, : key_len // bs], heads, first_pos, bs)
            key_pos = pair_start[rep][:, None] + np.arange(key_len)
            mask = None
            if not is_full[rep].all():
                mask = np.where(key_pos < ends[pair_seq[rep]][:, None], 0.0, -np.inf).astype(np.float32)
                mask = torch.from_numpy(mask[:, None, None, :]).to(device)
            rounds.append(DecodeRound(
                seqs=torch.from_numpy(seqs).to(device),
                slabs=torch.from_numpy(slabs.reshape(-1)).to(device),
                mask=mask,
                key_len=key_len,
            ))
    return rounds


def attend_with_lse(q, k, v, *, mask=None, is_causal=False, scale: float):
    """``q [B, heads, n, D]``, ``k``/``v [B, kv_heads, m, D]`` → (out ``[B, heads, n, D]``,
    log-sum-exp ``[B, heads, n]``). ``mask``: additive, broadcast to ``[B, heads, n, m]``;
    ``is_causal``: query ``i`` sees keys ``0..i``. Every row must see at least one key."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )
    # Elsewhere (CUDA without FlashInfer): plain maths, query rows in slices so that the
    # float32 scores stay under _MATH_SCORES elements whatever n and m are.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    num_queries, num_keys = q.shape[2], k.shape[2]
    rows = max(1, _MATH_SCORES // max(1, q.shape[0] * q.shape[1] * num_keys))
    outs, lses = [], []
    for lo in range(0, num_queries, rows):
        scores = (q[:, :, lo : lo + rows].float() @ k.transpose(-1, -2)) * scale  # [B, heads, rows, m]
        if mask is not None:
            scores = scores + mask[:, :, lo : lo + rows] if mask.shape[2] > 1 else scores + mask
        if is_causal:
            query_pos = torch.arange(lo, lo + scores.shape[2], device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(num_keys, device=q.device)[None, :] > query_pos, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(((scores - lse[..., None]).exp() @ v).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _weight(log_weight: torch.Tensor) -> torch.Tensor:
    """``exp(log_weight)``, exactly 0 below e^-60: such a weight adds nothing a float32 sum
    keeps, and products with it would be subnormal numbers (each op on one ~100x slower on x86)."""
    return torch.where(log_weight < -60.0, 0.0, log_weight.exp())


def _merge(acc_out, acc_lse, index, out, lse) -> torch.Tensor:
    """Fold partial results ``out [P, heads, D]``, ``lse [P, heads]`` of rows ``index [P]`` into
    ``acc_out [B, heads, D]`` (in place) and return the new ``acc_lse [B, heads]``."""
    top = acc_lse.scatter_reduce(0, index[:, None].expand_as(lse), lse, "amax")  # [B, heads]
    acc_weight = _weight(acc_lse - top)
    weight = _weight(lse - top.index_select(0, index))  # [P, heads]
    total = acc_weight.index_add(0, index, weight)
    acc_out.mul_(acc_weight[..., None]).index_add_(0, index, out * weight[..., None].to(out.dtype))
    acc_out.div_(total[..., None].to(acc_out.dtype))
    return top + total.log()


def _default_attention(q, key, value, pool, layer: int, plan: DefaultPlan, scale: float) -> torch.Tensor:
    num_heads, num_rows, head_dim = q.shape
    num_kv_heads = key.shape[0]
    out = q.new_empty(num_heads, num_rows, head_dim)
    if plan.decode_rows is not None:
        keys, values = pool.slabs(layer, 0, pool.block_size), pool.slabs(layer, 1, pool.block_size)  # [slabs, bs, D]
        num_decodes = plan.decode_rows.shape[0]
        qd = q[:, plan.decode_rows].transpose(0, 1)  # [B, heads, D]
        acc_out = qd.new_zeros(num_decodes, num_heads, head_dim)
        acc_lse = torch.full((num_decodes, num_heads), _EMPTY_LSE, dtype=torch.float32, device=q.device)
        # Partial results merged once for all rounds (or per plan.merge_pairs pairs): fewer ops per layer.
        held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        num_held = 0
        for work in plan.decode_rounds:
            num_chunks, num_sharers = work.seqs.shape
            seqs = work.seqs.view(-1)
            k = keys.index_select(0, work.slabs).view(num_chunks, num_kv_heads, work.key_len, head_dim)
            v = values.index_select(0, work.slabs).view(num_chunks, num_kv_heads, work.key_len, head_dim)
            # The query heads of a kv head, of every decode sharing the chunk, are rows of one query.
            qp = qd.index_select(0, seqs).view(num_chunks, num_sharers, num_kv_heads, -1, head_dim)
            qp = qp.transpose(1, 2).reshape(num_chunks, num_kv_heads, -1, head_dim)  # [chunks, kv, sharers * group, D]
            mask = None if work.mask is None else work.mask.to(q.dtype)
            o, lse = attend_with_lse(qp, k, v, mask=mask, scale=scale)
            o = o.view(num_chunks, num_kv_heads, num_sharers, -1, head_dim).transpose(1, 2)
            lse = lse.view(num_chunks, num_kv_heads, num_sharers, -1).transpose(1, 2)
            held.append((seqs, o.reshape(-1, num_heads, head_dim), lse.reshape(-1, num_heads).float()))
            num_held += seqs.shape[0]
            if num_held >= plan.merge_pairs or work is plan.decode_rounds[-1]:
                index, outs, lses = (torch.cat(parts) if len(held) > 1 else parts[0] for parts in zip(*held))
                acc_lse = _merge(acc_out, acc_lse, index, outs, lses)
                held, num_held = [], 0
        out[:, plan.decode_rows] = acc_out.transpose(0, 1)
    for work in plan.prefills:
        rows = slice(work.row, work.row + work.length)
        qc = q[None, :, rows]  # [1, heads, n, D]
        acc, acc_lse = attend_with_lse(qc, key[None, :, rows], value[None, :, rows], is_causal=True, scale=scale)
        acc = acc[0].transpose(0, 1).contiguous()  # [n, heads, D]: one "row" per query token
        acc_lse = acc_lse[0].transpose(0, 1).float()  # [n, heads]
        every_row = torch.arange(work.length, device=q.device)
        for pool_rows in work.past_rounds:
            k = pool.rows(layer, 0).index_select(0, pool_rows).view(1, num_kv_heads, -1, head_dim)
            v = pool.rows(layer, 1).index_select(0, pool_rows).view(1, num_kv_heads, -1, head_dim)
            o, lse = attend_with_lse(qc, k, v, scale=scale)
            acc_lse = _merge(acc, acc_lse, every_row, o[0].transpose(0, 1), lse[0].transpose(0, 1).float())
        out[:, rows] = acc.transpose(0, 1)
    return out.transpose(0, 1)


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
    out = step.plan.attend(query[0], key[0], value[0], pool, layer, scale)
    return out.unsqueeze(0), None


def register() -> None:
    """Make ``"kvroute_paged"`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
