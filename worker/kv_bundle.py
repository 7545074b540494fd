"""A cached prefix's KV as one self-describing bundle, for moving it between replicas.

:class:`KVBundle` is what crosses the process boundary (Ray's object store
in the cluster): the token ids and salt it was cached under, the model and KV
geometry it belongs to, its rows in one contiguous CPU tensor (laid out as
:data:`BUNDLE_FORMAT` says) and a checksum over all of that. It is
token-exact and independent of block layout: the importer may use another
``block_size``.

:func:`gather_rows` / :func:`scatter_rows` move rows between a
:class:`~worker.kv.KVPool` and a bundle's layout; the engine decides which
blocks (worker/engine.py ``export_prefix`` / ``import_prefix``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from worker.kv import KVPool

BUNDLE_FORMAT = 2
"""The rows' layout, carried by every bundle and checked on import (a bundle of
another format is refused, never reinterpreted). 1: ``[num_layers, 2,
num_tokens, num_kv_heads, head_dim]`` (token-major; bundles of 1 predate the
field, see :func:`_bundle_from_wire`); 2: ``[num_layers, 2, num_kv_heads,
num_tokens, head_dim]``, the pool's head-major order, copied block-wise
without a transpose."""


@dataclass(frozen=True, slots=True, eq=False)  # eq would compare tensors elementwise
class KVBundle:
    """The KV of ``token_ids`` cached under ``salt`` on a replica of ``model_id``.

    Invariants (checked by :meth:`check`, which an importer calls before
    touching its pool): ``format_version == BUNDLE_FORMAT``; ``rows`` is a
    contiguous CPU tensor of ``dtype`` shaped ``[num_layers, 2, num_kv_heads,
    num_tokens, head_dim]`` (axis 1: 0 keys, 1 values; ``rows[:, :, :, p]`` is
    position ``p``), ``num_tokens == len(token_ids) >= 1`` and ``checksum ==
    bundle_checksum(...)`` of the other fields. ``block_size`` is the
    exporter's (information only).
    ``weights_fingerprint``: :func:`weights_fingerprint` of the exporter's
    model; an importer whose weights differ (same name, other checkpoint or
    seed) refuses the bundle, since its KV would be wrong for them.
    """

    model_id: str
    dtype: str  # a torch dtype name, e.g. "float32"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    weights_fingerprint: int
    token_ids: tuple[int, ...]
    salt: str | None
    rows: torch.Tensor  # [num_layers, 2, num_kv_heads, num_tokens, head_dim], CPU, contiguous
    checksum: int  # xxh3-64 over the header and the rows' bytes
    format_version: int  # BUNDLE_FORMAT of the exporter; last, so format 1's wire tuple is a prefix

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __reduce__(self):
        """Pickled (a Ray return value) with its rows as one flat NumPy byte
        array, which Ray's serializer moves out of band: no copy into the
        pickle, read in place from the object store on arrival (torch's own
        tensor pickling copies them through ``torch.save``). The unpickled
        rows are then read-only (the store's memory): importers only read them."""
        fields = tuple(getattr(self, name) for name in self.__slots__ if name != "rows")
        raw = self.rows.contiguous().view(-1).view(torch.uint8).numpy()
        return _bundle_from_wire, (fields, raw, dtype_name(self.rows.dtype), tuple(self.rows.shape))

    @property
    def num_bytes(self) -> int:
        """Bytes of KV rows (what a transfer moves, besides a small header)."""
        return self.rows.numel() * self.rows.element_size()

    @classmethod
    def build(
        cls,
        *,
        model_id: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        weights_fingerprint: int,
        token_ids: Sequence[int],
        salt: str | None,
        rows: torch.Tensor,
    ) -> KVBundle:
        """A bundle of ``rows`` (moved to CPU, made contiguous) with its checksum computed."""
        rows = rows.detach().to("cpu").contiguous()
        dtype = dtype_name(rows.dtype)
        token_ids = tuple(int(t) for t in token_ids)
        checksum = bundle_checksum(model_id, dtype, num_layers, num_kv_heads, head_dim, weights_fingerprint,
                                   token_ids, salt, rows, BUNDLE_FORMAT)
        return cls(model_id, dtype, num_layers, num_kv_heads, head_dim, block_size, weights_fingerprint,
                   token_ids, salt, rows, checksum, BUNDLE_FORMAT)

    def check(self, *, model_id: str, dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int,
              weights_fingerprint: int) -> None:
        """Raise ValueError (naming the mismatch) unless this bundle fits a pool
        of that model, weights, dtype and geometry, in this code's
        :data:`BUNDLE_FORMAT`, and its checksum holds."""
        if self.format_version != BUNDLE_FORMAT:
            raise ValueError(f"bundle rows are in format {self.format_version!r}, this engine reads format"
                             f" {BUNDLE_FORMAT} (an exporter of another kvroute version)")
        if not isinstance(self.rows, torch.Tensor):
            raise ValueError(f"bundle rows must be a torch.Tensor, got {type(self.rows).__name__}")
        if self.model_id != model_id:
            raise ValueError(f"bundle is for model {self.model_id!r}, this engine serves {model_id!r}")
        if self.weights_fingerprint != weights_fingerprint:
            raise ValueError(f"bundle was computed with weights {self.weights_fingerprint:#x}, this engine's are"
                             f" {weights_fingerprint:#x}")
        if self.dtype != dtype_name(dtype) or self.rows.dtype != dtype:
            raise ValueError(f"bundle dtype {self.dtype} (rows {self.rows.dtype}), this pool holds {dtype}")
        geometry = (num_layers, num_kv_heads, head_dim)
        if (self.num_layers, self.num_kv_heads, self.head_dim) != geometry:
            raise ValueError(
                f"bundle geometry (layers, kv_heads, head_dim) = {(self.num_layers, self.num_kv_heads, self.head_dim)}"
                f", this pool's is {geometry}"
            )
        if self.salt is not None and not isinstance(self.salt, str):
            raise ValueError(f"bundle salt must be a str or None, got {type(self.salt).__name__}")
        if self.num_tokens < 1:
            raise ValueError("bundle holds no tokens")
        shape = (num_layers, 2, num_kv_heads, self.num_tokens, head_dim)
        if tuple(self.rows.shape) != shape:
            raise ValueError(f"bundle rows are shaped {tuple(self.rows.shape)}, expected {shape}")
        if self.rows.device.type != "cpu" or not self.rows.is_contiguous():
            raise ValueError("bundle rows must be a contiguous CPU tensor")
        expected = bundle_checksum(
            self.model_id, self.dtype, self.num_layers, self.num_kv_heads, self.head_dim,
            self.weights_fingerprint, self.token_ids, self.salt, self.rows, self.format_version,
        )
        if self.checksum != expected:
            raise ValueError(f"bundle checksum {self.checksum:#x} does not match its contents ({expected:#x})")


def _bundle_from_wire(fields: tuple, raw, dtype: str, shape: tuple[int, ...]) -> KVBundle:
    """:meth:`KVBundle.__reduce__` undone: the rows a view of ``raw`` (no copy).
    ``fields`` one short is a format-1 exporter's (no ``format_version`` yet):
    it arrives as format 1, which :meth:`KVBundle.check` refuses."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer from the object store
        flat = torch.from_numpy(raw)
    rows = flat.view(getattr(torch, dtype)).view(shape)
    names = [name for name in KVBundle.__slots__ if name != "rows"]
    if len(fields) == len(names) - 1:
        fields = (*fields, 1)
    values = dict(zip(names, fields, strict=True))
    return KVBundle(**values, rows=rows)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def bundle_checksum(
    model_id: str,
    dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    weights_fingerprint: int,
    token_ids: Sequence[int],
    salt: str | None,
    rows: torch.Tensor,
    format_version: int,
) -> int:
    """xxh3-64 over a header (format, model, dtype, geometry, weights, salt, token ids) and the rows' raw bytes."""
    digest = xxhash.xxh3_64()
    header = (f"kvbundle{format_version}\x00{model_id}\x00{dtype}\x00{num_layers}\x00{num_kv_heads}\x00{head_dim}\x00"
              f"{weights_fingerprint}\x00{salt!r}\x00")
    digest.update(header.encode("utf-8", "surrogatepass"))
    digest.update(",".join(map(str, token_ids)).encode())
    digest.update(b"\x00")
    digest.update(rows.contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.intdigest()


FINGERPRINT_TENSORS = 4  # parameter tensors hashed: the first, last and two between
FINGERPRINT_ELEMENTS = 4096  # leading elements hashed of each


def weights_fingerprint(model: torch.nn.Module) -> int:
    """A cheap identity of a model's weights, computed once at load: xxh3-64
    over every parameter's name and shape and the leading
    ``FINGERPRINT_ELEMENTS`` values of ``FINGERPRINT_TENSORS`` of them (spread
    over the model). Equal weights give equal fingerprints; another seed or
    checkpoint of the same architecture differs with near certainty (a
    fine-tune touching none of the sampled values would not: a cheap check,
    not a proof)."""
    digest = xxhash.xxh3_64()
    named = list(model.named_parameters())
    for name, parameter in named:
        digest.update(f"{name}:{tuple(parameter.shape)}\x00".encode())
    if named:
        picks = sorted({round(i * (len(named) - 1) / max(FINGERPRINT_TENSORS - 1, 1)) for i in range(FINGERPRINT_TENSORS)})
        for index in picks:
            values = named[index][1].detach().reshape(-1)[:FINGERPRINT_ELEMENTS].to("cpu", torch.float32)
            digest.update(values.contiguous().numpy().tobytes())
    return digest.intdigest()


def _block_ids(block_table: Sequence[int], first: int, stop: int, device) -> torch.Tensor:
    return torch.tensor(list(block_table[first:stop]), dtype=torch.long, device=device)


def gather_rows(pool: KVPool, block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
    """A CPU copy of positions ``[0, num_tokens)`` held by ``block_table``:
    ``[num_layers, 2, kv_heads, num_tokens, head_dim]`` (the pool's head-major
    order, so no transpose). One bounded copy, block-wise: the full blocks
    with one index over the pool's block axis (each a contiguous ``block_size
    × head_dim`` run per layer, kind and head), the partial last block sliced."""
    block_size = pool.block_size
    if len(block_table) * block_size < num_tokens:
        raise ValueError(f"{len(block_table)} blocks cannot hold {num_tokens} positions")
    num_full, num_tail = divmod(num_tokens, block_size)
    layers, _, kv_heads, _, _, head_dim = pool.data.shape
    # pool.data: [layers, 2, kv_heads, num_blocks + 1, block_size, head_dim]
    out = torch.empty(layers, 2, kv_heads, num_tokens, head_dim, dtype=pool.data.dtype, device=pool.data.device)
    if num_full:
        blocks = _block_ids(block_table, 0, num_full, pool.data.device)
        full = out[:, :, :, : num_full * block_size].view(layers, 2, kv_heads, num_full, block_size, head_dim)
        torch.index_select(pool.data, 3, blocks, out=full)  # straight into out's (strided) full-block part
    if num_tail:
        out[:, :, :, num_full * block_size:] = pool.data[:, :, :, block_table[num_full], :num_tail]
    return out.to("cpu")  # no copy when the pool is on the CPU; else one transfer


def scatter_rows(pool: KVPool, block_table: Sequence[int], start_pos: int, rows: torch.Tensor) -> None:
    """Write ``rows`` (``[num_layers, 2, kv_heads, n, head_dim]``, any strides)
    as positions ``[start_pos, start_pos + n)`` of ``block_table``; the caller
    holds those blocks alone (nothing the tree names is written). Block-wise:
    the rest of the block ``start_pos`` falls in (an import over a partly
    cached block starts there) and a partial last block by slicing, the full
    blocks between with one index over the block axis."""
    block_size = pool.block_size
    num_rows = rows.shape[3]
    end_pos = start_pos + num_rows
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    if len(block_table) * block_size < end_pos:
        raise ValueError(f"{len(block_table)} blocks cannot hold positions up to {end_pos}")
    if num_rows == 0:
        return
    rows = rows.to(pool.data.device, pool.data.dtype)  # [layers, 2, kv_heads, num_rows, head_dim]
    layers, _, kv_heads, _, head_dim = rows.shape
    done = 0  # rows written so far
    offset = start_pos % block_size
    if offset:  # the rest of the block start_pos falls in
        done = min(block_size - offset, num_rows)
        pool.data[:, :, :, block_table[start_pos // block_size], offset: offset + done] = rows[:, :, :, :done]
    first = (start_pos + done) // block_size
    num_full = (num_rows - done) // block_size
    if num_full:
        blocks = _block_ids(block_table, first, first + num_full, pool.data.device)
        full = rows[:, :, :, done: done + num_full * block_size]
        pool.data.index_copy_(3, blocks, full.reshape(layers, 2, kv_heads, num_full, block_size, head_dim))
        done += num_full * block_size
    if done < num_rows:  # a partial last block
        pool.data[:, :, :, block_table[first + num_full], : num_rows - done] = rows[:, :, :, done:]
