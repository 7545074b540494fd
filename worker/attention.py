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

Default kernel (plan: worker/default_plan.py): K/V are read in place from
the pool wherever a sequence's blocks are consecutive ids (the pool is
head-major across blocks, so such a run of every head is one strided view):
a run several decodes share (a cached prefix) is attended once with all
their query heads as rows; evenly spaced runs of equal length share one
call. Short scattered pieces (decode-grown blocks) are gathered in *rounds*
of at most ``scratch_tokens`` positions, so attention's scratch memory is
set by config, not by batch × context. A prefill chunk attends its own new
keys straight from the step's ``key``/``value`` (causal, no copy) and its
cached prefix the same way (in place, or gathered where scattered). The
partial results are merged by log-sum-exp (online softmax) once per layer.

Where the native kernel runs (worker/native/: CPU float32, built and
self-checked at load) the step gets worker/native_plan.py's plan instead, in
either mode; this kernel is the fallback elsewhere.

Merging partial results by log-sum-exp is exact up to float rounding; the
order of rounds depends on the batch, so this kernel is not batch-invariant
(deterministic mode uses the native kernel, or else the tiled one).
"""

from __future__ import annotations

import torch

from worker.default_plan import DECODE_KEY_CHUNK, DEFAULT_SCRATCH_TOKENS, DefaultPlan, build_default_plan

ATTN_IMPLEMENTATION = "kvroute_paged"
_MATH_SCORES = 1 << 24  # score elements the plain-maths fallback holds at once
_EMPTY_LSE = -1e30  # a running log-sum-exp before any key (finite: exp(-1e30 - m) == 0, never NaN)

__all__ = ["DECODE_KEY_CHUNK", "DEFAULT_SCRATCH_TOKENS", "DefaultPlan", "build_default_plan", "paged_attention"]


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


def _pool_runs(columns: torch.Tensor, call) -> torch.Tensor:
    """``[units, kv_heads, length, D]`` strided view of ``columns [kv_heads, cols, D]`` at ``call``'s runs."""
    if call.units == 1:
        return columns[None, :, call.start : call.start + call.length]
    head_stride, col_stride = columns.stride(0), columns.stride(1)
    return columns.as_strided(
        (call.units, columns.shape[0], call.length, columns.shape[2]),
        (call.step * col_stride, head_stride, col_stride, columns.stride(2)),
        columns.storage_offset() + call.start * col_stride,
    )


def default_attention(q, key, value, pool, layer: int, plan: DefaultPlan, scale: float) -> torch.Tensor:
    num_heads, num_rows, head_dim = q.shape
    num_kv_heads = key.shape[0]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_heads, num_rows, head_dim)
    if plan.decode_rows is not None:
        num_decodes = plan.decode_rows.shape[0]
        qd = q[:, plan.decode_rows].transpose(0, 1)  # [B, heads, D]
        acc_out = qd.new_zeros(num_decodes, num_heads, head_dim)
        acc_lse = torch.full((num_decodes, num_heads), _EMPTY_LSE, dtype=torch.float32, device=q.device)
        # Partial results merged once for all calls and rounds (or per plan.merge_pairs): fewer ops per layer.
        held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        num_held = 0

        def fold(seqs, o, lse, last):
            nonlocal held, num_held, acc_lse
            held.append((seqs, o, lse))
            num_held += seqs.shape[0]
            if num_held >= plan.merge_pairs or last:
                index, outs, lses = (torch.cat(parts) if len(held) > 1 else parts[0] for parts in zip(*held))
                acc_lse = _merge(acc_out, acc_lse, index, outs, lses)
                held, num_held = [], 0

        if plan.in_place:
            keys, values = pool.positions(layer, 0), pool.positions(layer, 1)  # [kv_heads, cols, D]
            q_rows = qd.index_select(0, plan.q_index)  # [rows, heads, D]
            outs, lses = [], []
            for call in plan.in_place:
                units, sharers = call.units, call.sharers
                qp = q_rows[call.rows].view(units, sharers, num_kv_heads, group, head_dim)
                # The query heads of a kv head, of every decode sharing the run, are rows of one query.
                qp = qp.transpose(1, 2).reshape(units, num_kv_heads, sharers * group, head_dim)
                o, lse = attend_with_lse(qp, _pool_runs(keys, call), _pool_runs(values, call), scale=scale)
                outs.append(o.view(units, num_kv_heads, sharers, group, head_dim).transpose(1, 2)
                            .reshape(-1, num_heads, head_dim))
                lses.append(lse.view(units, num_kv_heads, sharers, group).transpose(1, 2).reshape(-1, num_heads))
            o = torch.cat(outs) if len(outs) > 1 else outs[0]
            lse = torch.cat(lses) if len(lses) > 1 else lses[0]
            fold(plan.q_index, o, lse.float(), not plan.decode_rounds)
        if plan.decode_rounds:
            slabs_k, slabs_v = pool.slabs(layer, 0, pool.block_size), pool.slabs(layer, 1, pool.block_size)
        for work in plan.decode_rounds:
            num_chunks, num_sharers = work.seqs.shape
            seqs = work.seqs.view(-1)
            k = slabs_k.index_select(0, work.slabs).view(num_chunks, num_kv_heads, work.key_len, head_dim)
            v = slabs_v.index_select(0, work.slabs).view(num_chunks, num_kv_heads, work.key_len, head_dim)
            qp = qd.index_select(0, seqs).view(num_chunks, num_sharers, num_kv_heads, -1, head_dim)
            qp = qp.transpose(1, 2).reshape(num_chunks, num_kv_heads, -1, head_dim)  # [chunks, kv, sharers * group, D]
            mask = None if work.mask is None else work.mask.to(q.dtype)
            o, lse = attend_with_lse(qp, k, v, mask=mask, scale=scale)
            o = o.view(num_chunks, num_kv_heads, num_sharers, -1, head_dim).transpose(1, 2)
            lse = lse.view(num_chunks, num_kv_heads, num_sharers, -1).transpose(1, 2)
            fold(seqs, o.reshape(-1, num_heads, head_dim), lse.reshape(-1, num_heads).float(),
                 work is plan.decode_rounds[-1])
        out[:, plan.decode_rows] = acc_out.transpose(0, 1)
    for work in plan.prefills:
        rows = slice(work.row, work.row + work.length)
        qc = q[None, :, rows]  # [1, heads, n, D]
        acc, acc_lse = attend_with_lse(qc, key[None, :, rows], value[None, :, rows], is_causal=True, scale=scale)
        acc = acc[0].transpose(0, 1).contiguous()  # [n, heads, D]: one "row" per query token
        acc_lse = acc_lse[0].transpose(0, 1).float()  # [n, heads]
        every_row = torch.arange(work.length, device=q.device)
        for k, v in _prefill_keys(pool, layer, work, num_kv_heads, head_dim):
            o, lse = attend_with_lse(qc, k, v, scale=scale)
            acc_lse = _merge(acc, acc_lse, every_row, o[0].transpose(0, 1), lse[0].transpose(0, 1).float())
        out[:, rows] = acc.transpose(0, 1)
    return out.transpose(0, 1)


def _prefill_keys(pool, layer: int, work, num_kv_heads: int, head_dim: int):
    """A prefill chunk's cached keys/values ``[1, kv_heads, n, D]``: in-place views, then the
    gathered rounds one at a time (a generator: one round's copy alive at once)."""
    keys, values = pool.positions(layer, 0), pool.positions(layer, 1)
    for column, length in work.in_place:
        yield keys[None, :, column : column + length], values[None, :, column : column + length]
    for pool_rows in work.past_rounds:
        yield (pool.rows(layer, 0).index_select(0, pool_rows).view(1, num_kv_heads, -1, head_dim),
               pool.rows(layer, 1).index_select(0, pool_rows).view(1, num_kv_heads, -1, head_dim))


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
