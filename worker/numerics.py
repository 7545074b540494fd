"""Batch-invariant numerics: a token's activations get the same bits whatever
else shares its forward pass.

On CPU, torch gives one row of a matmul different bits depending on how many
rows are in the call, and element-wise transcendental kernels (SiLU, rsqrt)
take a vector or a scalar path, or another thread's chunk, depending on the
tensor's total size (see ../shared/DESIGN.md, "Deterministic mode"). Every
call here therefore has a fixed shape per 16-row tile:

- :class:`TiledLinear`: one GEMM over zero-padded ``[16, in]`` tiles (the
  pre-packed oneDNN kernel of worker/linear.py or ``F.linear``);
  :func:`rows_are_invariant` checks at start-up, per weight shape and kernel,
  that it gives each row the same bits for every multiple of 16 rows up to
  the step size; where the packed kernel fails the layer takes the plain one,
  and where that fails too a true per-tile ``bmm``, slower but fixed-shape by
  construction;
- :class:`PerTile`: wraps a row-wise module (the MLP activation, and a norm
  that fails :func:`module_rows_are_invariant`) and calls it once per
  ``[16, hidden]`` tile. RMSNorm needs no tiling where its ``rsqrt`` is the
  correctly rounded ``1 / sqrt`` (checked at start-up): its other ops are
  exact element-wise ops and a fixed-length row mean;
- :class:`RopeTable`: cos/sin looked up in a table computed once for every
  position, so a position's rotation never depends on the batch.

:func:`make_batch_invariant` swaps these into a loaded Hugging Face model in
place (weights are shared, not copied). The engine pads each step's flattened
batch to a multiple of :data:`TILE_ROWS` tokens so tiles never straddle the
end. Attention has its own tiled kernel (worker/tiled_attention.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from worker.linear import PackedLinear, gemm_rows

TILE_ROWS = 16


def pad_rows(num_rows: int) -> int:
    """``num_rows`` rounded up to whole tiles."""
    return -(-num_rows // TILE_ROWS) * TILE_ROWS


class TiledLinear(nn.Module):
    """A linear layer computed over zero-padded 16-row tiles.

    Wraps an ``nn.Linear`` or a pre-packed :class:`worker.linear.PackedLinear`
    (its parameters are shared, not copied). Input ``[..., in]``; rows are
    padded with zeros up to whole tiles and the padding is dropped from the
    output. ``per_tile_bmm`` (``nn.Linear`` only): one ``[16, in] x [in, out]``
    product per tile (``bmm``) instead of one GEMM over all padded rows.
    """

    def __init__(self, linear: nn.Module, *, per_tile_bmm: bool = False) -> None:
        super().__init__()
        if per_tile_bmm and not isinstance(linear, nn.Linear):
            raise ValueError("per_tile_bmm needs an nn.Linear")
        self.linear = linear
        self.bias = linear.bias
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.per_tile_bmm = per_tile_bmm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        num_padded = pad_rows(num_rows)
        if num_padded != num_rows:
            rows = torch.cat([rows, rows.new_zeros(num_padded - num_rows, self.in_features)])
        if self.per_tile_bmm:
            tiles = rows.view(-1, TILE_ROWS, self.in_features)  # [num_tiles, 16, in]
            weight_t = self.linear.weight.t().expand(tiles.shape[0], self.in_features, self.out_features)
            out = torch.bmm(tiles, weight_t).view(num_padded, self.out_features)
        else:
            out = gemm_rows(rows, self.linear)  # one GEMM over whole tiles
        if self.bias is not None:
            out = out + self.bias
        return out[:num_rows].view(*lead, self.out_features)


class PerTile(nn.Module):
    """Calls a row-wise module once per 16-row tile (fixed-shape calls)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, width = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, width)
        num_rows = rows.shape[0]
        num_padded = pad_rows(num_rows)
        if num_padded != num_rows:
            rows = torch.cat([rows, rows.new_zeros(num_padded - num_rows, width)])
        out = torch.cat([self.inner(tile) for tile in rows.split(TILE_ROWS)])
        return out[:num_rows].view(*lead, out.shape[-1])


class RopeTable(nn.Module):
    """A rotary-embedding module answered from a per-position table.

    ``forward(x, position_ids) -> (cos, sin)`` like the wrapped module; the
    table is that module's output for positions ``0 .. max_positions - 1``,
    computed once in float32.
    """

    def __init__(self, rotary: nn.Module, max_positions: int, device: torch.device) -> None:
        super().__init__()
        positions = torch.arange(max_positions, device=device)[None]
        probe = torch.zeros(1, device=device, dtype=torch.float32)
        with torch.no_grad():
            cos, sin = rotary(probe, positions)
        self.register_buffer("cos", cos[0].float(), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", sin[0].float(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def install_rope_table(model: nn.Module, max_positions: int) -> int:
    """Replace every position-only rotary embedding with a :class:`RopeTable`.

    Rotary types whose frequencies depend on the sequence length ("dynamic")
    are left alone. Returns how many modules were replaced.
    """
    device = next(model.parameters()).device
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not type(child).__name__.endswith("RotaryEmbedding"):
                continue
            if getattr(child, "rope_type", "default") == "dynamic":
                continue
            setattr(parent, name, RopeTable(child, max_positions, device))
            replaced += 1
    return replaced


@functools.lru_cache(maxsize=None)
def rows_are_invariant(in_features: int, out_features: int, max_rows: int, dtype, device, gemm: str = "plain") -> bool:
    """Does one GEMM (``gemm``: "plain" ``F.linear`` or "packed" oneDNN) give every
    row the same bits for 16, 32, ..., ``max_rows`` rows?

    Checks every multiple of 16 up to 128 rows, then powers of two and
    ``max_rows``, against the full product, on seeded random data (cached
    per process: the answer is a property of the BLAS and the shape).
    """
    generator = torch.Generator(device="cpu").manual_seed(1234)
    num_rows = pad_rows(max(max_rows, TILE_ROWS))
    x = torch.randn(num_rows, in_features, generator=generator).to(device=device, dtype=dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(device=device, dtype=dtype) * 0.05
    layer = PackedLinear(weight, None) if gemm == "packed" else nn.Linear(in_features, out_features, bias=False)
    if gemm != "packed":
        layer.weight = nn.Parameter(weight, requires_grad=False)
    full = gemm_rows(x, layer)
    counts = set(range(TILE_ROWS, min(num_rows, 128) + 1, TILE_ROWS))
    counts |= {1 << k for k in range(4, num_rows.bit_length()) if 1 << k <= num_rows} | {num_rows}
    for count in sorted(counts):
        if not torch.equal(gemm_rows(x[:count], layer), full[:count]):
            return False
    return True


def module_rows_are_invariant(module: nn.Module, width: int, max_rows: int, dtype, device) -> bool:
    """Does a row-wise module give each row the same bits for 16, 32, ... ``max_rows`` rows?"""
    generator = torch.Generator(device="cpu").manual_seed(99)
    num_rows = pad_rows(max(max_rows, TILE_ROWS))
    x = (torch.randn(num_rows, width, generator=generator) * 3).to(device=device, dtype=dtype)
    with torch.no_grad():
        full = module(x)
        for count in range(TILE_ROWS, num_rows + 1, TILE_ROWS):
            if not torch.equal(module(x[:count]), full[:count]):
                return False
    return True


def make_batch_invariant(model: nn.Module, max_rows: int, gemm: str = "plain") -> dict[str, int]:
    """Swap in tiled linears, per-tile norms and activations, in place.

    ``max_rows``: the most tokens one forward carries (the step budget).
    ``gemm``: "packed" tiles a linear over pre-packed weights where that
    kernel passes :func:`rows_are_invariant` for the layer's shape (else the
    plain GEMM, else a per-tile ``bmm``). Norms are recognised by class name
    (``*RMSNorm``, ``*LayerNorm``), the activation by the attribute name
    ``act_fn`` (Llama, Qwen2, Mistral MLPs). Returns counts of what was found
    and replaced (``packed``: linears on the packed GEMM; ``per_tile_bmm``:
    linears whose shape failed every GEMM's probe; ``norm_per_tile``: norms
    that failed :func:`module_rows_are_invariant` and are called per tile).
    """
    counts = {"linear": 0, "packed": 0, "per_tile_bmm": 0, "norm": 0, "norm_per_tile": 0, "activation": 0}
    for parent in list(model.modules()):
        if isinstance(parent, (TiledLinear, PerTile, RopeTable)):
            continue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                shape = (child.in_features, child.out_features, max_rows, child.weight.dtype, child.weight.device)
                if gemm == "packed" and rows_are_invariant(*shape, gemm="packed"):
                    tiled = TiledLinear(PackedLinear(child.weight, child.bias))
                    counts["packed"] += 1
                else:
                    tiled = TiledLinear(child, per_tile_bmm=not rows_are_invariant(*shape))
                setattr(parent, name, tiled)
                counts["linear"] += 1
                counts["per_tile_bmm"] += tiled.per_tile_bmm
            elif type(child).__name__.endswith(("RMSNorm", "LayerNorm")):
                counts["norm"] += 1
                weight = child.weight
                if not module_rows_are_invariant(child, weight.shape[-1], max_rows, weight.dtype, weight.device):
                    setattr(parent, name, PerTile(child))
                    counts["norm_per_tile"] += 1
            elif name == "act_fn":
                setattr(parent, name, PerTile(child))
                counts["activation"] += 1
    return counts
