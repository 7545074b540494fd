"""Batch-invariant numerics: a token's activations get the same bits whatever
else shares its forward pass.

On CPU, torch gives one row of a matmul different bits depending on how many
rows are in the call, and element-wise transcendental kernels (SiLU, rsqrt)
take a vector or a scalar path, or another thread's chunk, depending on the
tensor's total size (see ../shared/DESIGN.md, "Deterministic mode"). Every
call here therefore has a fixed shape per 16-row tile:

- :class:`TiledLinear`: one batched matmul over zero-padded ``[16, in]`` tiles;
- :class:`PerTile`: wraps a row-wise module (RMSNorm, the MLP activation) and
  calls it once per ``[16, hidden]`` tile;
- :class:`RopeTable`: cos/sin looked up in a table computed once for every
  position, so a position's rotation never depends on the batch.

:func:`make_batch_invariant` swaps these into a loaded Hugging Face model in
place (weights are shared, not copied). The engine pads each step's flattened
batch to a multiple of :data:`TILE_ROWS` tokens so tiles never straddle the
end. Attention has its own tiled kernel (worker/attention.py).
"""

from __future__ import annotations

import torch
from torch import nn

TILE_ROWS = 16


def pad_rows(num_rows: int) -> int:
    """``num_rows`` rounded up to whole tiles."""
    return -(-num_rows // TILE_ROWS) * TILE_ROWS


class TiledLinear(nn.Module):
    """``nn.Linear`` computed as a batched matmul over 16-row tiles.

    Shares the wrapped layer's parameters. Input ``[..., in]``; rows are padded
    with zeros up to whole tiles and the padding is dropped from the output.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        num_padded = pad_rows(num_rows)
        if num_padded != num_rows:
            rows = torch.cat([rows, rows.new_zeros(num_padded - num_rows, self.in_features)])
        tiles = rows.view(-1, TILE_ROWS, self.in_features)  # [num_tiles, 16, in]
        weight_t = self.weight.t().expand(tiles.shape[0], self.in_features, self.out_features)
        out = torch.bmm(tiles, weight_t).view(num_padded, self.out_features)
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


def make_batch_invariant(model: nn.Module) -> dict[str, int]:
    """Swap in tiled linears, per-tile norms and activations, in place.

    Norms are recognised by class name (``*RMSNorm``, ``*LayerNorm``), the
    activation by the attribute name ``act_fn`` (Llama, Qwen2, Mistral MLPs).
    Returns counts of what was replaced.
    """
    counts = {"linear": 0, "norm": 0, "activation": 0}
    for parent in list(model.modules()):
        if isinstance(parent, (TiledLinear, PerTile, RopeTable)):
            continue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, TiledLinear(child))
                counts["linear"] += 1
            elif type(child).__name__.endswith(("RMSNorm", "LayerNorm")):
                setattr(parent, name, PerTile(child))
                counts["norm"] += 1
            elif name == "act_fn":
                setattr(parent, name, PerTile(child))
                counts["activation"] += 1
    return counts
