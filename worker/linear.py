"""Linear layers on the fastest float32 GEMM torch offers on this machine, and
fused projections (one GEMM for q/k/v, one for gate/up).

GEMM. On an x86 CPU with oneDNN, torch can pre-pack a weight once into the
blocked layout its GEMM reads (``torch.ops.mkldnn._reorder_linear_weight``)
and multiply against it (``torch.ops.mkldnn._linear_pointwise``), skipping
the per-call reorder and MKL's small-matrix overheads that ``F.linear`` pays.
:func:`choose_gemm` picks the packed kernel at load time where it exists for
the dtype and device and its results are within float32 rounding of
``F.linear`` (checked on seeded data); else the plain one. The packed
weight replaces the original (same memory, opaque layout), so a packed
layer has no ``.weight``.

Fused projections. :func:`fuse_projections` concatenates a Llama-style
attention's ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` and an
MLP's ``gate_proj``/``up_proj`` into one ``gate_up_proj`` (weights copied
once, originals dropped) and gives the module a forward that splits the
single output. Each output element is the same dot product as before; only
the GEMM's width changes. Modules whose layout is not the plain one
(q/k norms, other names) are left alone.

Deterministic mode. worker/numerics.py's tiled linears call
:func:`gemm_rows` as their GEMM; whether a kernel gives a row the same bits
for every row count is probed there per shape, for whichever kernel is in
use.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

GEMMS = ("packed", "plain")


def packed_is_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's pre-packed float32 linear exists here (CPU, float32 only)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.lru_cache(maxsize=None)
def choose_gemm(dtype: torch.dtype, device_type: str) -> str:
    """``"packed"`` where available and within float32 rounding of ``F.linear``, else ``"plain"``."""
    device = torch.device(device_type)
    if not packed_is_available(dtype, device):
        return "plain"
    generator = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(37, 256, generator=generator)
    weight = torch.randn(96, 256, generator=generator) * 0.05
    bias = torch.randn(96, generator=generator)
    try:
        packed = PackedLinear(weight, bias)(x)
    except RuntimeError:
        return "plain"
    return "packed" if torch.allclose(packed, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5) else "plain"


ROW_BUCKET = 16  # PackedLinear pads its rows to a multiple of this (bounded oneDNN primitive caches)


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` pre-packed once for oneDNN. Input ``[..., in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 128) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # opaque mkldnn layout, [out, in] logically; batch_hint only tunes the blocking
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rows padded with zeros to a multiple of :data:`ROW_BUCKET`: oneDNN
        (ideep's LRU and its primitive cache, 1,024 entries each) keeps one
        primitive of ~0.1-0.6 MiB per distinct row count it has seen, so a
        serving engine's varying step sizes (1..max_batch_tokens rows) grew a
        Worker by ~400 MiB of native memory, plus the holes that evicting them
        leaves (issue 12's soak). Padded, a layer sees at most
        ``max_batch_tokens / ROW_BUCKET`` shapes, all cached."""
        num_rows = x.numel() // self.in_features
        padded = -(-num_rows // ROW_BUCKET) * ROW_BUCKET
        if padded == num_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = torch.cat([x.reshape(num_rows, self.in_features), x.new_zeros(padded - num_rows, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out[:num_rows].reshape(*x.shape[:-1], self.out_features)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + (x Wᵀ + b)`` in one oneDNN call (a binary post-op on the GEMM's float32
        result): the same bits as the separate add (IEEE addition is exact-commutative and the
        post-op adds the rounded product; :func:`fused_add_is_exact` checks it). Rows padded as
        :meth:`forward` pads them."""
        num_rows = x.numel() // self.in_features
        padded = -(-num_rows // ROW_BUCKET) * ROW_BUCKET
        rows = x.reshape(num_rows, self.in_features)
        other = residual.reshape(num_rows, self.out_features)
        if padded != num_rows:
            rows = torch.cat([rows, rows.new_zeros(padded - num_rows, self.in_features)])
            other = torch.cat([other, other.new_zeros(padded - num_rows, self.out_features)])
        out = torch.ops.mkldnn._linear_pointwise.binary(rows, other.contiguous(), self.packed, self.bias, "add")
        return out[:num_rows].reshape(residual.shape)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.lru_cache(maxsize=None)
def fused_add_is_exact() -> bool:
    """Does :meth:`PackedLinear.forward_add` give the bits of ``residual + layer(x)`` here
    (seeded data, with and without bias, whole and padded row counts)?"""
    generator = torch.Generator(device="cpu").manual_seed(5)
    weight = torch.randn(48, 80, generator=generator) * 0.1
    for bias in (None, torch.randn(48, generator=generator)):
        layer = PackedLinear(weight, bias)
        for num_rows in (16, 37):
            x, residual = torch.randn(num_rows, 80, generator=generator), torch.randn(num_rows, 48, generator=generator)
            try:
                fused = layer.forward_add(x, residual)
            except RuntimeError:
                return False
            if not torch.equal(fused, residual + layer(x)):
                return False
    return True


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + layer(x)``: one fused call for a :class:`PackedLinear` where that is exact, else two."""
    if type(layer) is PackedLinear and fused_add_is_exact():
        return layer.forward_add(x, residual)
    return residual + layer(x)


def gemm_rows(rows: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``rows [n, in]`` → ``[n, out]`` through ``layer`` (an ``nn.Linear`` or a :class:`PackedLinear`), no bias."""
    if isinstance(layer, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise(rows, layer.packed, None, "none", [], "")
    return F.linear(rows, layer.weight)


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` by a :class:`PackedLinear` in place; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced


def concat_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the parts' outputs side by side."""
    first = parts[0]
    has_bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=has_bias,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    fused.requires_grad_(False)
    return fused


def _is_plain(module: nn.Module, names: tuple[str, ...]) -> bool:
    layers = [getattr(module, name, None) for name in names]
    if not all(type(layer) is nn.Linear for layer in layers):
        return False
    return len({layer.in_features for layer in layers}) == 1 and len({layer.bias is None for layer in layers}) == 1


def fuse_projections(model: nn.Module) -> dict[str, int]:
    """Fuse q/k/v and gate/up projections in place; returns counts of fused modules."""
    counts = {"qkv": 0, "gate_up": 0}
    for module in list(model.modules()):
        name = type(module).__name__
        if name.endswith("Attention") and _is_plain(module, ("q_proj", "k_proj", "v_proj", "o_proj")):
            if any(hasattr(module, norm) for norm in ("q_norm", "k_norm")):
                continue
            rotary = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
            if rotary is None:
                continue
            parts = [module.q_proj, module.k_proj, module.v_proj]
            module.qkv_sizes = [p.out_features for p in parts]
            module.qkv_proj = concat_linears(parts)
            module.apply_rotary = rotary
            module.rotate_in_one_pass = rotary_matches(rotary)
            del module.q_proj, module.k_proj, module.v_proj
            module.forward = types.MethodType(_fused_attention_forward, module)
            counts["qkv"] += 1
        elif (name.endswith("MLP") and _is_plain(module, ("gate_proj", "up_proj"))
              and type(getattr(module, "down_proj", None)) is nn.Linear and hasattr(module, "act_fn")):
            module.intermediate = module.gate_proj.out_features
            module.gate_up_proj = concat_linears([module.gate_proj, module.up_proj])
            del module.gate_proj, module.up_proj
            module.forward = types.MethodType(_fused_mlp_forward, module)
            counts["gate_up"] += 1
    return counts


_SIGNED_SIN: list = [None, None]  # (the sin tensor last seen, its signed copy): shared by a step's layers


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == swap_halves(x) * signed_sin(sin)``
    bit for bit (negating is exact). Memoised on the tensor (every layer of a step gets the same one)."""
    if _SIGNED_SIN[0] is not sin:
        half = sin.shape[-1] // 2
        _SIGNED_SIN[1] = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        _SIGNED_SIN[0] = sin
    return _SIGNED_SIN[1]


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding ``x * cos + rotate_half(x) * sin`` on ``x [..., T, heads, D]``
    (cos/sin ``[..., T, D]``) in four ops for all heads at once, with the same bits."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + swapped * signed_sin(sin).unsqueeze(-2)


def rotary_matches(rotary) -> bool:
    """Does a model's ``apply_rotary_pos_emb`` give exactly :func:`rotate_heads`' bits (seeded data)?"""
    generator = torch.Generator().manual_seed(11)
    q, k = torch.randn(1, 6, 5, 16, generator=generator), torch.randn(1, 2, 5, 16, generator=generator)
    angles = torch.randn(1, 5, 8, generator=generator).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    try:
        q_ref, k_ref = rotary(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - an unknown signature: keep the model's own function
        return False
    both = rotate_heads(torch.cat((q, k), dim=1).transpose(1, 2), cos, sin).transpose(1, 2)
    return torch.equal(both[:, :6], q_ref) and torch.equal(both[:, 6:], k_ref)


def _fused_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """A Llama-style attention forward over one fused q/k/v GEMM (same maths as the original;
    where :func:`rotary_matches`, the rotary embedding of q and k in one pass, same bits)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings
    if self.rotate_in_one_pass:
        qkv = self.qkv_proj(hidden_states).view(hidden_shape)  # [batch, T, heads + 2 kv_heads, D]
        num_q, num_k = self.qkv_sizes[0] // self.head_dim, self.qkv_sizes[1] // self.head_dim
        qk = rotate_heads(qkv[..., : num_q + num_k, :], cos, sin)
        query = qk[..., :num_q, :].transpose(1, 2)  # [batch, heads, T, D]
        key = qk[..., num_q:, :].transpose(1, 2)  # [batch, kv_heads, T, D]
        value = qkv[..., num_q + num_k :, :].transpose(1, 2)
    else:
        query, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
        query = query.view(hidden_shape).transpose(1, 2)  # [batch, heads, T, D]
        key = key.view(hidden_shape).transpose(1, 2)  # [batch, kv_heads, T, D]
        value = value.view(hidden_shape).transpose(1, 2)
        query, key = self.apply_rotary(query, key, cos, sin)
    attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, weights = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _fused_mlp_forward(self, x):
    gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)
