"""Process-level CPU settings for inference (best effort, logged).

- glibc ``malloc`` hands large blocks back to the kernel on ``free`` and
  page-faults them in again on the next ``malloc``: a forward's temporaries
  (gathered K/V, scores) would pay that every step. Raising the mmap and trim
  thresholds keeps them in the heap (measured on a 2-core CPU: the default
  mode's step time dropped by about a third).
- ``torch.set_num_threads``: intra-op threads; with several replicas on one
  machine, give each ``cores / replicas`` so they do not oversubscribe.
- Thread binding (:data:`OMP_BINDING`): OpenMP threads pinned one per core
  (``OMP_PROC_BIND=close OMP_PLACES=cores``, read by libgomp when torch
  loads, so it must be in the process's environment from the start). vLLM's
  CPU engine pins its threads the same way (``VLLM_CPU_OMP_THREADS_BIND``).
  worker.bench sets it for its own process so both sides run pinned. On the
  2-core VM (~125M model) ``python -m worker.profile_step`` steps were
  steadier bound (decode 85-90 ms vs 90-115 unbound), but the benchmark's
  wall times did not move (BENCHMARKS.md, engine, "Thread binding"). Only for
  one engine process per set of cores: two bound processes on one machine
  both start at core 0, so the Serve config leaves it unset.

Both are process-wide: they affect everything else in the process too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's maximum on 64-bit
_TRIM_THRESHOLD_BYTES = 2**30

_tuned = False

OMP_BINDING = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


def omp_is_bound(environ: dict[str, str]) -> bool:
    """Does ``environ`` pin OpenMP threads (any ``OMP_PROC_BIND`` other than false)?"""
    return environ.get("OMP_PROC_BIND", "false").lower() not in ("false", "")


def tune_malloc() -> bool:
    """Raise glibc's mmap/trim thresholds once per process; False where that is not glibc."""
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1 and ok
    except (OSError, AttributeError):
        return False
    _tuned = ok
    logger.info("malloc thresholds raised: %s", ok)
    return ok


def set_threads(num_threads: int | None) -> None:
    """``torch.set_num_threads(num_threads)`` unless None."""
    if num_threads is not None and torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
        logger.info("torch intra-op threads: %d", num_threads)
