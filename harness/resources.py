"""What a scenario's processes cost: CPU seconds from /proc and getrusage,
resident memory of the app's replicas and Ray cluster (``harness/chaos.py``'s
overload figures)."""

from __future__ import annotations

import os
import resource

from harness import faults


def cpu_s(pids) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far."""
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


# Serve's HTTP front: its Python proxy, or HAProxy and the actor managing it (HAProxy ingress)
ROLES = (("ProxyActor", "proxy"), ("HAProxyManager", "proxy"), ("haproxy", "proxy"), (":Ingress", "ingress"),
         (":Worker", "workers"))


def role_of(pid: int) -> str:
    """``proxy`` (Serve's proxy, or HAProxy and its manager), ``ingress``,
    ``workers`` (Serve replicas by their process title) or ``ray`` (GCS, raylet, controller, dashboard, ...)."""
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "ray"
    return next((role for marker, role in ROLES if marker in cmdline), "ray")


def cpu_s_by_role(pids) -> dict[str, float]:
    """CPU seconds so far per :func:`role_of` role."""
    out = {role: 0.0 for _, role in ROLES} | {"ray": 0.0}
    for pid in pids:
        out[role_of(pid)] += cpu_s([pid])
    return out


def own_cpu_s() -> float:
    """CPU seconds (user + system) this process has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def memory_figures(app, headers: dict | None) -> dict:
    """Each Worker replica's resident memory and the whole Ray cluster's, in MiB."""
    workers = {replica: faults.rss_bytes(pid) for replica, pid in faults.replica_pids(app.url, headers).items()}
    return {"workers_mib": {r: round((v or 0) / 2**20, 1) for r, v in sorted(workers.items())},
            "cluster_mib": round(sum(faults.rss_bytes(pid) or 0 for pid in app.ray_pids()) / 2**20, 1)}
