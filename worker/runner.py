"""Runs the model on a step: chunks in, float32 logits of the requested rows out.

Owns the loaded model with its numerics fixed at construction: the RoPE
table and fused q/k/v and gate/up projections always, the GEMM kernel
chosen at load time (worker/linear.py), the batch-invariant layers
(worker/numerics.py) and the tiled attention kernel in deterministic mode. Holds no KV state: the pool is an
argument, so the engine and the plain reference server share one runner
(same weights, same numerics) with separate pools.

The forward is worker/lean_forward.py's loop over the model's own modules
where that loop gives the same logits, bit for bit, as transformers' own
``model(...)`` on probe steps run at load time (:meth:`ModelRunner.forward_path`
says which); else transformers' forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker import attention, native
from worker.attention import DEFAULT_SCRATCH_TOKENS
from worker.config import EngineConfig
from worker.gpu_attention import flashinfer_available
from worker.kv import KVPool
from worker.lean_forward import LeanForward, lean_forward_for
from worker.linear import choose_gemm, fuse_projections, pack_linears
from worker.model import LoadedModel, TinyLlamaSpec, load_model
from worker.numerics import install_rope_table, make_batch_invariant
from worker.step import SeqChunk, build_step
from worker.tiled_attention import TILE_ROWS, choose_share_rows, choose_tile_rows


class ModelRunner:
    def __init__(
        self,
        model: str,
        spec: TinyLlamaSpec,
        *,
        device: str,
        dtype: str,
        deterministic: bool,
        max_batch_tokens: int = 2048,
        max_positions: int | None = None,
        trust_remote_code: bool = False,
        gemm: str = "auto",
        attention_scratch_tokens: int = DEFAULT_SCRATCH_TOKENS,
        attention_kernel: str = "auto",
        lean: bool | None = None,
    ) -> None:
        """``gemm``: "auto" (the packed kernel where :func:`choose_gemm` picks it), "packed" or "plain";
        ``attention_scratch_tokens``: K/V positions the default attention kernel gathers at once;
        ``attention_kernel``: "auto" (on CPU float32 the native kernel, both modes, where it builds and
        passes its self-checks; FlashInfer on CUDA in default mode where it imports; else torch's), "torch",
        "native" (an error where it cannot run) or "flashinfer"; ``lean``: None (the lean forward where the load-time probe
        finds it equal to transformers' forward), False (always transformers' forward)."""
        if attention_kernel not in ("auto", "torch", "native", "flashinfer"):
            raise ValueError(f"attention_kernel must be auto, torch, native or flashinfer, got {attention_kernel!r}")
        self.attention_scratch_tokens = attention_scratch_tokens
        attention.register()
        self.loaded: LoadedModel = load_model(
            model, spec, device=device, dtype=dtype,
            attn_implementation=attention.ATTN_IMPLEMENTATION, trust_remote_code=trust_remote_code,
        )
        self.deterministic = deterministic
        self.device = torch.device(device)
        self.flashinfer = not deterministic and (
            attention_kernel == "flashinfer"
            or (attention_kernel == "auto" and self.device.type == "cuda" and flashinfer_available())
        )
        self.dtype = getattr(torch, dtype)
        # The native kernel attends every token where it runs (both modes; else torch's kernels).
        self.native = attention_kernel in ("auto", "native") and self._native_fits(deterministic)
        if attention_kernel == "native" and not self.native:
            raise ValueError("attention_kernel 'native' cannot run here (default mode on CPU float32, a"
                             " supported geometry and a C++ compiler; see the log)")
        self.max_positions = max_positions or self.loaded.max_position_embeddings
        install_rope_table(self.loaded.model, self.max_positions)
        self.fused = fuse_projections(self.loaded.model)
        self.gemm = choose_gemm(self.dtype, self.device.type) if gemm == "auto" else gemm
        # The plain reference prefills a whole prompt in one forward: calibrate up to max_positions rows.
        max_rows = max(max_batch_tokens, self.max_positions)
        self.swapped = {}
        if deterministic:
            self.swapped = make_batch_invariant(self.loaded.model, max_rows, gemm=self.gemm)
        elif self.gemm == "packed":
            self.swapped = {"packed": pack_linears(self.loaded.model)}
        geometry = self.loaded.geometry
        self.tile_rows = (TILE_ROWS, TILE_ROWS)  # (decode, prefill) tiles of the batch-invariant kernel
        self.share_rows = 0  # rows of its products over a key block several tiles read (0: not shared)
        if deterministic:
            group = geometry.num_heads // geometry.num_kv_heads
            self.tile_rows = choose_tile_rows(group, geometry.head_dim, self.dtype, self.device)
            self.share_rows = choose_share_rows(self.tile_rows[0], geometry.head_dim, self.dtype, self.device)
        self.lean: LeanForward | None = None
        if lean is not False:
            candidate = lean_forward_for(self.loaded.model)
            if candidate is not None and self._probe_agrees(candidate):
                self.lean = candidate

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelRunner:
        return cls(
            config.model, config.tiny_llama, device=config.device, dtype=config.dtype,
            deterministic=config.deterministic, max_batch_tokens=max(config.max_batch_tokens, 64),
            max_positions=config.max_model_len, trust_remote_code=config.trust_remote_code, gemm=config.gemm,
            attention_scratch_tokens=config.attention_scratch_tokens, attention_kernel=config.attention_kernel,
        )

    def _native_fits(self, deterministic: bool) -> bool:
        """The native kernel fits this model and machine: it builds, loads and agrees with dense
        attention on a self-check of this geometry (worker/native/), and in deterministic mode
        gives a token the same bits in any chunk."""
        geometry = self.loaded.geometry
        if not native.supports(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, self.dtype, self.device):
            return False
        if native.load() is None:
            return False
        shape = (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, 16)
        return native.self_check(*shape) and (not deterministic or native.self_check_invariance(*shape))

    @property
    def attention_path(self) -> str:
        """The attention kernel: ``"native"`` (worker/native/, every token, both modes),
        ``"flashinfer"``, ``"torch"`` or, deterministic mode without the native kernel, ``"tiled"``."""
        if self.native:
            return "native"
        if self.deterministic:
            return "tiled"
        return "flashinfer" if self.flashinfer else "torch"

    @property
    def geometry(self):
        return self.loaded.geometry

    def new_pool(self, num_blocks: int, block_size: int) -> KVPool:
        return KVPool(self.geometry, num_blocks, block_size, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], pool: KVPool) -> torch.Tensor:
        """Write the chunks' K/V into ``pool``; return ``[num_wanted, vocab]`` float32
        logits after the last token of each chunk with ``needs_logits``, in order."""
        step = self._build(chunks, pool)
        if self.lean is not None:
            return self.lean.forward(step).float()
        return self._hf_forward(step)

    @property
    def forward_path(self) -> str:
        """``"lean"`` (worker/lean_forward.py) or ``"transformers"``."""
        return "transformers" if self.lean is None else "lean"

    def _hf_forward(self, step) -> torch.Tensor:
        output = self.loaded.model(
            input_ids=step.input_ids[None],
            position_ids=step.position_ids[None],
            use_cache=False,
            logits_to_keep=step.logits_rows,
            kvroute_step=step,
        )
        return output.logits[0].float()

    def _build(self, chunks: Sequence[SeqChunk], pool: KVPool):
        return build_step(
            chunks, pool, deterministic=self.deterministic,
            pad_token_id=self.loaded.pad_token_id, num_heads=self.geometry.num_heads,
            tile_rows=self.tile_rows, scratch_tokens=self.attention_scratch_tokens, flashinfer=self.flashinfer,
            share_rows=self.share_rows, native=self.native,
        )

    @torch.inference_mode()
    def _probe_agrees(self, lean: LeanForward) -> bool:
        """Do ``lean`` and transformers' forward give equal logits (``torch.equal``) and write equal
        K/V on two probe steps (a prefill; then a decode beside another sequence's prefill), each
        path on a fresh pool of its own? Seeded tokens; a few forwards of at most 8 tokens."""
        generator = torch.Generator().manual_seed(17)
        tokens = torch.randint(0, self.loaded.vocab_size, (13,), generator=generator).tolist()
        block_size = 16
        steps = [
            [SeqChunk(tokens[:7], 0, [0], True)],
            [SeqChunk(tokens[7:8], 7, [0], True), SeqChunk(tokens[8:], 0, [1], True)],
        ]
        pools = [self.new_pool(2, block_size), self.new_pool(2, block_size)]
        for chunks in steps:
            expected = self._hf_forward(self._build(chunks, pools[0]))
            try:
                got = lean.forward(self._build(chunks, pools[1])).float()
            except Exception:  # noqa: BLE001 - a model the loop does not fit: keep transformers' forward
                return False
            if not torch.equal(got, expected):
                return False
        return torch.equal(pools[0].data, pools[1].data)
