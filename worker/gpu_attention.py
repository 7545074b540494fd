"""Paged attention on CUDA through FlashInfer, reading K/V in place by block table.

Chosen by worker/step.py for default-mode steps on a CUDA device when the
``flashinfer`` package imports; elsewhere the torch kernel of
worker/attention.py runs (its GPU fallback). The pool is read in
FlashInfer's "HND" paged layout as a strided view: each layer's keys are
``[num_blocks + 1, kv_heads, block_size, head_dim]`` pages
(``KVPool.block_view``: the pool itself is head-major across blocks, so the
page stride is ``block_size * head_dim`` and the head stride that of one
head's whole pool; FlashInfer takes a paged cache's strides from the
tensor), values the same, so nothing is copied. One ``BatchPrefillWithPagedKVCacheWrapper``
plan per step serves every layer; decodes are chunks of one query, and a
chunk's queries are causal aligned to the end of its context (query ``i``
of ``n`` sees keys ``< end - n + i + 1``), which is this engine's
semantics. Scratch is the wrapper's fixed workspace
(:data:`WORKSPACE_BYTES`), allocated once per device.

Not batch-invariant: deterministic mode keeps the tiled torch kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from worker.chunk_arrays import ChunkArrays

WORKSPACE_BYTES = 256 * 2**20


@functools.lru_cache(maxsize=None)
def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a build that fails to load its kernels
        return False
    return True


@functools.lru_cache(maxsize=None)
def _wrapper(device: torch.device):
    import flashinfer

    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="HND")


@dataclass(slots=True)
class FlashInferPlan:
    wrapper: object  # flashinfer.BatchPrefillWithPagedKVCacheWrapper, planned for this step
    num_tokens: int  # real rows; padding rows (none in default mode) are left zero
    scale: float  # softmax scale the wrapper was planned with (1 / sqrt(head_dim))

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool, layer: int, scale: float):
        """``q [heads, T, D]`` → ``[T, heads, D]`` over the pool's pages (this step's K/V written already)."""
        if abs(scale - self.scale) > 1e-9 * self.scale:
            raise ValueError(f"FlashInfer plan made for scale {self.scale}, the model asks {scale}")
        queries = q[:, : self.num_tokens].transpose(0, 1).contiguous()  # [T, heads, D]
        out = self.wrapper.run(queries, (pool.block_view(layer, 0), pool.block_view(layer, 1)))
        if out.shape[0] == q.shape[1]:
            return out
        padded = q.new_zeros(q.shape[1], q.shape[0], q.shape[2])
        padded[: self.num_tokens] = out
        return padded


def build_flashinfer_plan(
    chunks: ChunkArrays, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> FlashInferPlan:
    """One plan for the step: per chunk its query rows, its pages and the last page's fill."""
    bs, scale = chunks.block_size, head_dim**-0.5
    ends = chunks.ends
    pages = -(-ends // bs)  # pages each chunk's context covers
    page_indices = np.concatenate([chunks.tables[i, : pages[i]] for i in range(len(ends))])
    qo_indptr = np.concatenate([[0], np.cumsum(chunks.lengths)])
    kv_indptr = np.concatenate([[0], np.cumsum(pages)])
    last_page_len = ends - (pages - 1) * bs

    def tensor(array):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).to(device)

    wrapper = _wrapper(device)
    wrapper.plan(
        tensor(qo_indptr), tensor(kv_indptr), tensor(page_indices), tensor(last_page_len),
        num_heads, chunks.num_kv_heads, head_dim, bs, causal=True, sm_scale=scale,
        q_data_type=dtype, kv_data_type=dtype,
    )
    return FlashInferPlan(wrapper, int(chunks.lengths.sum()), scale)
