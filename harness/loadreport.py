"""Print and plot a load-test report (routers side by side)."""

from __future__ import annotations


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pair(dist: dict | None) -> str:
    """``p50/p99`` of a ``_dist``, or "-" where the run had none."""
    if not dist or dist.get("p50") is None:
        return "-"
    return f"{_fmt(dist['p50'])}/{_fmt(dist['p99'])}"


def _counter(result: dict, key: str) -> str:
    """A figure of the replicas' /stats counters over the run(s) (harness/replica_counters.py)."""
    return _fmt(result.get("replica_counters", {}).get(key))


def _mb_per_s(value, unit: float = 1e6) -> str:
    return "-" if value is None else f"{value / unit:.0f}"


def _estimates(counters: dict, key: str = "estimated_bandwidth_bytes_per_s", unit: float = 1e6) -> str:
    """Each replica's own transfer-model figure after the run (of the last run when pooled)."""
    estimates = counters.get(key) or {}
    values = estimates[-1] if isinstance(estimates, list) else sorted(estimates.values())
    return " ".join(_mb_per_s(v, unit) for v in values) or "-"


def _cpu_by_role(result: dict) -> str:
    """CPU ms per request: Serve's proxy / the Ingress / the Workers (comparisons only)."""
    cpu = result.get("cpu_ms_per_request_by_role") or {}
    return "/".join(f"{cpu[role]:.0f}" for role in ("proxy", "ingress", "workers")) if cpu else "-"


def _routers_seen(result: dict) -> str:
    """Per round, how many routers each Ingress's router read sharing the
    traffic, with where its balance term's busy time came from (c: the
    replicas' counters, s: its own spans, o: off); "/" between Ingresses."""
    source = {"replica_counters": "c", "own_spans": "s", "off": "o"}
    stats = [x.get("server_stats", {}) for x in result.get("rounds", ())] or [result.get("server_stats", {})]
    rounds = ["/".join(f"{r['routers_seen']:.1f}{source.get(r.get('balance_busy_source'), '?')}"
                       for r in s.get("routing", ()) if "routers_seen" in r) for s in stats]
    return " ".join(text or "-" for text in rounds)


def print_table(report: dict) -> None:
    results = report["results"]
    rows = [
        ("requests ok", lambda r: f"{r['num_ok']}/{r['num_requests']}"),
        ("cluster hit rate", lambda r: _fmt(r["cluster_hit_rate"])),
        ("request hit rate", lambda r: _fmt(r["request_hit_rate"])),
        ("throughput req/s", lambda r: _fmt(r["throughput_rps"], 2)),
        ("output tok/s", lambda r: _fmt(r["output_tokens_per_s"], 1)),
        ("goodput req/s", lambda r: _fmt(r["goodput_rps"], 2)),
        ("TTFT p50 s", lambda r: _fmt(r["ttft_s"]["p50"])),
        ("TTFT p99 s", lambda r: _fmt(r["ttft_s"]["p99"])),
        ("engine TTFT p50/p99 s", lambda r: _pair(r.get("server_ttft_s"))),
        ("  of it queue p50/p99", lambda r: _pair(r.get("server_queue_s"))),
        ("outside engine p50/p99", lambda r: _pair(r.get("ingress_overhead_s"))),
        ("ITL p50 s", lambda r: _fmt(r["itl_s"]["p50"])),
        ("ITL p99 s", lambda r: _fmt(r["itl_s"]["p99"])),
        ("latency p50 s", lambda r: _fmt(r["latency_s"]["p50"])),
        ("latency p90 s", lambda r: _fmt(r["latency_s"]["p90"])),
        ("latency p99 s", lambda r: _fmt(r["latency_s"]["p99"])),
        ("load imbalance", lambda r: _fmt(r["load_imbalance"])),
        ("busy imbalance", lambda r: _fmt(r.get("busy_imbalance"))),
        ("requests/replica", lambda r: " ".join(str(v["requests"]) for v in r["per_replica"].values())),
        ("hit rate/replica", lambda r: " ".join(_fmt(v["hit_rate"], 2) for v in r["per_replica"].values())),
        ("sessions/replica", lambda r: " ".join(_fmt(v.get("sessions")) for v in r["per_replica"].values())),
        ("decode ms/tok/replica", lambda r: " ".join(_fmt(None if v.get("decode_s_per_token_p50") is None
                                                          else 1e3 * v["decode_s_per_token_p50"], 1)
                                                     for v in r["per_replica"].values())),
        ("hit rate/round", lambda r: " ".join(_fmt(x["cluster_hit_rate"], 3) for x in r.get("rounds", [])) or "-"),
        ("TTFT p99 s/round", lambda r: " ".join(_fmt(x["ttft_s"]["p99"], 2) for x in r.get("rounds", [])) or "-"),
        ("computed prompt tok", lambda r: _counter(r, "computed_prompt_tokens")),
        ("reused local tok", lambda r: _counter(r, "reused_local_tokens")),
        ("fetched tok", lambda r: _counter(r, "fetched_tokens")),
        ("hints/ignored", lambda r: f"{_counter(r, 'num_hints')}/{_counter(r, 'num_hints_ignored')}"),
        ("fetches/fallbacks", lambda r: f"{_counter(r, 'num_fetches')}/{_counter(r, 'num_fallbacks')}"),
        ("outwaited fetches", lambda r: _counter(r, "num_outwaited")),
        ("export prefill waits", lambda r: _counter(r, "num_export_waits")),
        ("fetch MB/s (runs)", lambda r: _mb_per_s(r.get("replica_counters", {}).get("fetch_bandwidth_bytes_per_s"))),
        ("est. MB/s/replica", lambda r: _estimates(r.get("replica_counters", {}))),
        ("est. overhead ms", lambda r: _estimates(r.get("replica_counters", {}), "estimated_overhead_s", 1e-3)),
        ("routers seen/round", _routers_seen),
        ("CPU ms/req prx/ing/wrk", _cpu_by_role),
        ("errors", lambda r: str(r["errors"] or "-")),
    ]
    names = list(results)
    cells = [(label, [cell(results[n]) for n in names]) for label, cell in rows]
    width = max(20, *(len(n) + 2 for n in names), *(len(text) + 2 for _, texts in cells for text in texts))
    print(f"{'':22}" + "".join(f"{n:>{width}}" for n in names))
    for label, texts in cells:
        print(f"{label:22}" + "".join(f"{text:>{width}}" for text in texts))


def write_plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = list(results)
    panels = [
        ("cluster hit rate", [results[n]["cluster_hit_rate"] for n in names]),
        ("TTFT p99 (s)", [results[n]["ttft_s"]["p99"] or 0 for n in names]),
        ("TTFT p50 (s)", [results[n]["ttft_s"]["p50"] or 0 for n in names]),
        ("throughput (req/s)", [results[n]["throughput_rps"] for n in names]),
    ]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4 * (len(panels) + 1), 3.5))
    for axis, (title, values) in zip(axes, panels):
        axis.bar(names, values, color=["#999999", "#6699cc", "#cc6633", "#66aa66"][: len(names)])
        axis.set_title(title)
        axis.tick_params(axis="x", rotation=20)
    axis = axes[-1]
    for offset, name in enumerate(names):
        counts = [v["requests"] for v in results[name]["per_replica"].values()]
        axis.bar([i + offset * 0.25 for i in range(len(counts))], counts, width=0.25, label=name)
    num_replicas = max(len(results[n]["per_replica"]) for n in names)
    axis.set_xticks([i + 0.25 for i in range(num_replicas)], [f"#{i + 1}" for i in range(num_replicas)])
    axis.set_title("requests per replica (busiest first)")
    axis.legend(fontsize=7)
    meta = report["meta"]
    rounds = f" x {meta['rounds']} rounds" if meta.get("rounds") else ""
    fig.suptitle(f"{meta['workload']} ({meta['num_requests']} requests{rounds}, {meta['mode']} loop)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
