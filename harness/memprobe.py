"""Memory of live Worker replicas, measured from inside them (the soak's
``--probe``): to tell a leak of Python objects from allocator behaviour.

The harness connects to the app's Ray cluster as a driver and runs the
``inside_*`` functions in each Worker replica's actor process with Ray's
``__ray_call__`` (so the Worker's code carries no debug hooks). Each report:

- ``rss_mib``: the process's resident memory;
- ``malloc``: glibc's ``mallinfo2`` (``in_use_mib``: bytes malloc has handed
  out and not had back; ``free_mib``: freed bytes glibc keeps in its arenas;
  ``mmap_mib``: large blocks mapped directly; ``arena_mib``: the arenas' size);
- ``python``: ``tracemalloc``'s traced bytes (from :func:`inside_start` on)
  and the number of gc-tracked objects, with the types whose count grew most
  since the previous report;
- ``top_growth``: the source lines whose live traced bytes grew most since the
  previous report (``tracemalloc`` snapshot diff).

Reading: RSS growing with ``in_use`` flat and ``free`` growing is the
allocator keeping freed memory (fragmentation; ``malloc_trim`` gives it back,
:func:`inside_trim` measures how much); ``in_use`` growing with the traced
Python bytes flat is native memory (torch); traced bytes growing is a Python
leak and ``top_growth`` names the line that allocates it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import tracemalloc
from collections import Counter

_state: dict = {}  # per process: the previous snapshot and type counts (lives in the Worker)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    return ctypes.CDLL("libc.so.6")


def _rss_mib() -> float:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _malloc_figures() -> dict:
    libc = _libc()
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    mib = 2 ** 20
    return {"in_use_mib": round((info.uordblks + info.hblkhd) / mib, 1), "free_mib": round(info.fordblks / mib, 1),
            "mmap_mib": round(info.hblkhd / mib, 1), "arena_mib": round(info.arena / mib, 1)}


def malloc_in_use_mib() -> float:
    """This process's bytes in use through malloc (heap + mmapped blocks), MiB."""
    return _malloc_figures()["in_use_mib"]


def inside_start(_actor, nframes: int = 6) -> dict:
    """Start tracing Python allocations in this process (from now on)."""
    if not tracemalloc.is_tracing():
        tracemalloc.start(nframes)
    _state.clear()
    return inside_report(_actor, top=0)


def inside_report(_actor, top: int = 12) -> dict:
    """The figures above; ``top_growth`` against the previous report."""
    gc.collect()
    types = Counter(type(o).__name__ for o in gc.get_objects())
    previous_types = _state.get("types", types)
    report = {"pid": os.getpid(), "rss_mib": _rss_mib(), "malloc": _malloc_figures(),
              "python": {"num_objects": sum(types.values()),
                         "type_growth": dict(Counter({t: n - previous_types.get(t, 0) for t, n in types.items()})
                                             .most_common(8))}}
    _state["types"] = types
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        report["python"]["traced_mib"] = round(sum(s.size for s in snapshot.statistics("filename")) / 2**20, 2)
        report["python"]["tracemalloc_overhead_mib"] = round(tracemalloc.get_tracemalloc_memory() / 2**20, 1)
        previous = _state.get("snapshot")
        if previous is not None and top:
            report["top_growth"] = [
                {"kib": round(s.size_diff / 1024, 1), "count": s.count_diff,
                 "where": " < ".join(f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno}"
                                     for f in s.traceback[:4])}
                for s in snapshot.compare_to(previous, "traceback")[:top]]
        _state["snapshot"] = snapshot
    return report


def inside_trim(_actor) -> dict:
    """``malloc_trim(0)``: RSS before and after (what the allocator held free)."""
    before = _rss_mib()
    _libc().malloc_trim(0)
    return {"rss_before_mib": before, "rss_after_mib": _rss_mib()}


def worker_actors(app_name: str = "kvroute", deployment: str = "Worker") -> list:
    """Handles of the app's live ``deployment`` replica actors (needs ``ray.init``)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def call_all(actors: list, function, *args, timeout_s: float = 60.0) -> list[dict]:
    """``function(actor_instance, *args)`` in each actor's process."""
    import ray

    return ray.get([actor.__ray_call__.remote(function, *args) for actor in actors], timeout=timeout_s)


def connect(app) -> None:
    """Join the cluster of the :class:`~harness.serving.ServeApp` ``app`` as a driver."""
    os.environ.update({k: v for k, v in app._env().items() if k.startswith("RAY_")})  # read when ray loads
    import ray

    ray.init(address=app.address, namespace="kvroute-probe", logging_level="ERROR", log_to_driver=False)
