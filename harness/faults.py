"""Fault injection and process measurements for a local app (reliability tests,
``python -m harness.chaos``).

Every action is confined to the Ray cluster a :class:`~harness.serving.ServeApp`
started: a replica is killed only by the PID it reports itself in ``/stats``
and only if that PID belongs to this app's Ray session; nothing here stops
processes by name.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import httpx


def replica_stats(url: str, headers: dict | None = None) -> dict[str, dict]:
    """``GET /stats``'s per-replica entries (at most a few stats periods old)."""
    response = httpx.get(f"{url}/stats", headers=headers, timeout=10, trust_env=False)
    response.raise_for_status()
    return response.json()["replicas"]


def replica_pids(url: str, headers: dict | None = None) -> dict[str, int]:
    """``{replica_id: pid}`` as each Worker replica reports ``os.getpid()``."""
    return {replica_id: stats["pid"] for replica_id, stats in replica_stats(url, headers).items() if "pid" in stats}


def wait_until_replicas_busy(url: str, num_replicas: int, *, timeout_s: float = 30.0,
                             headers: dict | None = None) -> None:
    """Until ``num_replicas`` replicas report a running request (as the stats
    board shows them, at most a stats period late); TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    busy: list[str] = []
    while time.monotonic() < deadline:
        busy = [replica for replica, stats in replica_stats(url, headers).items() if stats.get("num_running", 0) > 0]
        if len(busy) >= num_replicas:
            return
        time.sleep(0.1)
    raise TimeoutError(f"only {len(busy)} of {num_replicas} replicas were running a request after {timeout_s} s")


def kill_replica(app, replica_id: str, headers: dict | None = None) -> int:
    """SIGKILL one Worker replica's process (as if the machine under it failed).

    ``app``: the :class:`~harness.serving.ServeApp` that started the cluster;
    the PID must be one of its Ray processes. Returns the PID killed."""
    pid = replica_pids(app.url, headers)[replica_id]
    if pid not in app.ray_pids():
        raise ValueError(f"pid {pid} of {replica_id} is not a process of this app's Ray cluster")
    os.kill(pid, signal.SIGKILL)
    return pid


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as file:
            for line in file:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True, slots=True)
class Audit:
    """A replica's self-check as posted to ``/stats`` (see worker/audit.py)."""

    replica_id: str
    posted_s: float  # wall-clock time the stats were taken
    is_clean: bool
    details: dict


def wait_for_clean_audits(url: str, num_replicas: int, *, after_s: float, timeout_s: float = 30.0,
                          headers: dict | None = None) -> list[Audit]:
    """Audits of ``num_replicas`` replicas all taken after ``after_s`` (wall
    clock) with idle engines; returns them whether clean or not once each has
    one, or raises TimeoutError."""
    deadline = time.time() + timeout_s
    latest: dict[str, Audit] = {}
    while time.time() < deadline:
        for replica_id, stats in replica_stats(url, headers).items():
            audit = stats.get("audit")
            posted_s = time.time() - stats.get("age_s", 0.0)
            if audit is not None and audit["is_idle"] and posted_s > after_s:
                latest[replica_id] = Audit(replica_id, posted_s, audit["is_clean"], audit)
        if len(latest) >= num_replicas:
            return list(latest.values())
        time.sleep(0.5)
    raise TimeoutError(f"only {len(latest)} of {num_replicas} replicas posted an idle audit: {latest}")
