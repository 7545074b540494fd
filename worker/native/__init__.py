"""Native CPU kernels: C++ compiled once on the machine that runs them, loaded with ctypes.

torch has no CPU kernel that attends through a block table; the default
kernel (worker/attention.py) composes one out of ~30 small torch ops per
layer, and on a decode step those ops, not the arithmetic, are the cost.
``paged_attention.cpp`` here is one call per layer instead: query tokens'
attention read in place from the pool, a cached prefix read once for every
token sharing it, batch-invariant (see its header for the algorithm).
worker/native_plan.py hands it every token of a step, in either mode.

Build: the first :func:`load` compiles the source with the system C++
compiler (``c++ -O3 -march=native -fopenmp``) into a per-user cache keyed by
the source, the flags, the compiler and the CPU, then loads it; later loads
(every Worker replica, every test) reuse the file. No compiler, a failed
build or an unsupported shape → ``None`` / ``False``, and callers keep the
torch path: nothing here is required for correctness.

On the machine: a C++ compiler (g++ or clang++) with OpenMP; the library
needs no torch headers. ``-march=native`` code never moves between CPUs:
the cache key holds the CPU's feature flags.

The library is linked against ``libgomp.so.1`` only by name; torch is
imported first and has loaded its own, so the kernel's OpenMP threads are
torch's pool, and each call asks for ``torch.get_num_threads()`` of them
(OpenMP's own default is per calling thread, which an engine thread would
not share with ``torch.set_num_threads``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno")
ABI_VERSION = 5
MAX_GROUP_ROWS = 64  # query rows (members x query heads per KV head) one work item attends together

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "kvroute" / "native"


def _cpu_fingerprint() -> str:
    """The CPU's feature flags (``-march=native`` code must not run on a CPU that lacks them)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def library_path(cache_dir: Path, compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_fingerprint().encode(),
                 str(ABI_VERSION).encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir / f"kvroute_native_{key.hexdigest()[:16]}.so"


def build(cache_dir: Path | None = None) -> Path:
    """Compile the kernels (if this source/compiler/CPU has no library yet) and return its path.
    Raises ``RuntimeError`` with the compiler's output when it cannot."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    cache_dir = cache_dir or default_cache_dir()
    target = library_path(cache_dir, compiler)
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent builders (replicas starting together) never
    # load a half-written file, and the last rename wins with identical content.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The kernels' library, built on first use; ``None`` where it cannot be built or loaded
    (logged once). Thread-safe; tried once per process."""
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        try:
            library = ctypes.CDLL(str(build()))
            if library.kvroute_native_abi_version() != ABI_VERSION:
                raise RuntimeError("library ABI version mismatch")
            fn = library.kvroute_paged_attention
            fn.restype = ctypes.c_int
            fn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                           _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, ctypes.c_int]
            _library = library
        except Exception as exc:  # noqa: BLE001 - any failure means "use the torch path"
            logger.warning("native kernels unavailable, using the torch path: %s", exc)
            _library = None
        return _library


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`paged_attention` handles this geometry (CPU float32, GQA group <= 16,
    head_dim a multiple of 8 up to 256)."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and num_kv_heads >= 1
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 16
        and head_dim % 8 == 0
        and head_dim <= 256
    )


CHUNK_KEYS = 128  # the kernel's online-softmax chunk (kChunkKeys): shared lengths are multiples of it


@dataclass(frozen=True, slots=True)
class MemberGroups:
    """How :func:`paged_attention` splits a step's query tokens ("members": a decode, or one token
    of a prefill chunk) into work: groups of members whose tables start with the same block (a
    cached prefix, or one chunk's own table), each group's common prefix read once for all its
    members' query rows, and the (group, KV head) work items. All int64, contiguous.

    Within a group, members are ordered by (table, end). A group's shared length is a multiple
    of :data:`CHUNK_KEYS`, so every row's keys are cut into the same chunks whatever its group:
    a row's result depends only on its query, its end and the keys (batch-invariant)."""

    rows: torch.Tensor  # query row of each member (in q and out), group after group
    tables: torch.Tensor  # the member's block table: a row of the step's tables
    ends: torch.Tensor  # the member attends positions [0, end)
    starts: torch.Tensor  # [num_groups + 1]: group g is members [starts[g], starts[g + 1])
    shared_lens: torch.Tensor  # [num_groups] leading positions all members attend in the same blocks
    items: torch.Tensor  # [num_groups * kv_heads, 2] (group, KV head), group-major

    @classmethod
    def of(cls, tables: np.ndarray, member_tables: np.ndarray, member_rows: np.ndarray, member_ends: np.ndarray,
           block_size: int, num_kv_heads: int, max_members: int) -> MemberGroups:
        """Groups of at most ``max_members`` members with the same first block (ordered by it,
        then table, then end); a group's shared length is its members' common leading blocks,
        capped at its shortest member's end, rounded down to a multiple of :data:`CHUNK_KEYS`."""
        num_members = len(member_rows)
        first_block = tables[member_tables, 0]
        order = np.lexsort((member_ends, member_tables, first_block))
        first = first_block[order]
        new_run = np.r_[True, first[1:] != first[:-1]]
        run_start = np.maximum.accumulate(np.where(new_run, np.arange(num_members), 0))
        starts = np.flatnonzero((np.arange(num_members) - run_start) % max_members == 0)
        table_rows = member_tables[order]
        leader = np.repeat(table_rows[starts], np.diff(np.r_[starts, num_members]))
        same = np.logical_and.accumulate(tables[table_rows] == tables[leader], axis=1).sum(axis=1)
        ends = member_ends[order]
        shared = np.minimum(np.minimum.reduceat(same, starts) * block_size, np.minimum.reduceat(ends, starts))
        shared -= shared % CHUNK_KEYS
        num_groups = len(starts)
        items = np.stack([np.repeat(np.arange(num_groups), num_kv_heads), np.tile(np.arange(num_kv_heads), num_groups)], 1)
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
        return cls(as_tensor(member_rows[order]), as_tensor(table_rows), as_tensor(ends),
                   as_tensor(np.r_[starts, num_members]), as_tensor(shared), as_tensor(items))


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, groups: MemberGroups,
    block_size: int, scale: float, out: torch.Tensor,
) -> torch.Tensor:
    """Attention of the members' query rows over their paged contexts, into ``out``.

    ``q``/``out [rows, heads, D]`` (last dim contiguous; other rows of ``out`` untouched);
    ``k_pool``/``v_pool`` one layer's ``[kv_heads, pool_blocks, block_size, D]`` contiguous
    (``KVPool.data[layer, 0]``); ``tables [num_tables, max_blocks]`` int64 block ids covering
    each member's positions. The caller checks :func:`supports`; the library must have loaded."""
    library = _library or load()  # once per layer per step: skip load()'s lock once loaded
    if library is None:
        raise RuntimeError("native kernels are not available")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, pool_blocks = k_pool.shape[0], k_pool.shape[1]
    if q.stride(2) != 1 or out.stride(2) != 1 or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("paged_attention needs q's and out's last dim and the pools contiguous")
    if tables.dtype != torch.int64 or not tables.is_contiguous():
        raise ValueError("paged_attention needs contiguous int64 tables")
    status = library.kvroute_paged_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(),
        tables.stride(0), groups.rows.data_ptr(), groups.tables.data_ptr(), groups.ends.data_ptr(),
        groups.starts.data_ptr(), groups.shared_lens.data_ptr(), groups.items.data_ptr(), groups.items.shape[0],
        out.data_ptr(), out.stride(0), out.stride(1), num_heads, num_kv_heads, head_dim, block_size, pool_blocks, scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"paged_attention does not support heads {num_heads}/{num_kv_heads}, head_dim {head_dim}")
    return out


def paged_decode(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
    block_size: int, scale: float, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (``q [seqs, heads, D]``, sequence ``i`` reads ``tables[i]``
    up to ``context_lens[i]``) → ``out [seqs, heads, D]``: :func:`paged_attention` with a member per
    sequence."""
    if context_lens.dtype != torch.int64:
        raise ValueError("paged_decode needs int64 context lengths")
    num_seqs, num_heads = q.shape[0], q.shape[1]
    seqs = np.arange(num_seqs)
    groups = MemberGroups.of(tables.numpy(), seqs, seqs, context_lens.numpy(), block_size, k_pool.shape[0],
                             max_members_for(num_heads, k_pool.shape[0]))
    if out is None:
        out = q.new_empty(q.shape)
    return paged_attention(q, k_pool, v_pool, tables, groups, block_size, scale, out)


def max_members_for(num_heads: int, num_kv_heads: int) -> int:
    """Decodes one work item takes together: at most :data:`MAX_GROUP_ROWS` query rows."""
    return max(1, MAX_GROUP_ROWS // max(1, num_heads // num_kv_heads))


def self_check(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Does :func:`paged_decode` give dense softmax attention (to float32 rounding) on a small
    seeded case of this geometry: scattered blocks, contexts of 1 to 300 positions, a partial
    last block, two decodes sharing a prefix's blocks? Run once at load, before the kernel is
    chosen (a miscompiled library is never used)."""
    generator = torch.Generator().manual_seed(23)
    lengths = [1, block_size, block_size + 3, 300, 290]
    max_blocks = -(-max(lengths) // block_size)
    pool_blocks = len(lengths) * max_blocks + 1
    shape = (num_kv_heads, pool_blocks, block_size, head_dim)
    k_pool, v_pool = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    order = torch.randperm(pool_blocks - 1, generator=generator)  # scattered tables
    tables = order[: len(lengths) * max_blocks].view(len(lengths), max_blocks).contiguous()
    tables[4, : 250 // block_size] = tables[3, : 250 // block_size]  # a shared cached prefix
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    got = paged_decode(q, k_pool, v_pool, tables, torch.tensor(lengths), block_size, scale)
    group = num_heads // num_kv_heads
    for seq, length in enumerate(lengths):
        positions = torch.arange(length)
        blocks = tables[seq, positions // block_size]
        k = k_pool[:, blocks, positions % block_size].double().repeat_interleave(group, 0)  # [heads, n, D]
        v = v_pool[:, blocks, positions % block_size].double().repeat_interleave(group, 0)
        weights = torch.softmax((k @ q[seq].double()[:, :, None])[..., 0] * scale, dim=-1)  # [heads, n]
        expected = (weights[:, None, :] @ v)[:, 0].float()
        if not torch.allclose(got[seq], expected, rtol=1e-4, atol=1e-5):
            return False
    return True


def self_check_invariance(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Does a token get the same bits (``torch.equal``) alone as a decode and as the last row of
    prefill chunks of several lengths over the same keys? Deterministic mode runs every token
    through the kernel only where this holds (it does by construction; this guards a compiler
    that contracts or vectorizes one block of rows differently from another)."""
    generator = torch.Generator().manual_seed(29)
    length = 300
    num_blocks = -(-length // block_size)
    shape = (num_kv_heads, num_blocks + 1, block_size, head_dim)
    k_pool, v_pool = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    tables = torch.arange(num_blocks)[None].contiguous()
    q = torch.randn(length, num_heads, head_dim, generator=generator)
    results = []
    for chunk in (1, 3, 45, 172, length):
        rows = np.arange(length - chunk, length)
        groups = MemberGroups.of(tables.numpy(), np.zeros(chunk, dtype=np.int64), rows, rows + 1, block_size,
                                 num_kv_heads, max_members_for(num_heads, num_kv_heads))
        out = torch.zeros_like(q)
        paged_attention(q, k_pool, v_pool, tables, groups, block_size, head_dim**-0.5, out)
        results.append(out[-1])
    return all(torch.equal(r, results[0]) for r in results[1:])
