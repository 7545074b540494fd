"""What the replicas' own ``/stats`` counters say about one load-test run:
prompt tokens computed, reused from the local cache, and fetched from
another replica (issue 13), with the fetch bandwidth the workers measured,
and the routing summaries they sent (issue 14, item 5).

The counters are cumulative since each replica started, so a run's figures
are the difference of two ``GET /stats`` snapshots taken around it (after
the warm-up and after the last request, each at least one stats period
after the traffic it should include). Replicas present in only one snapshot
are left out and named. Keys a replica does not report (a build without
fetch) read as absent, never as zero: ``missing`` names them.
"""

from __future__ import annotations

COUNTERS = ("prefill_tokens", "tokens_saved", "hits", "misses", "fetch_count", "fetch_tokens", "fetch_bytes",
            "fetch_seconds", "fetch_joined", "fetch_exports", "fetch_exported_bytes", "fetch_hints", "fetch_hints_ignored",
            "summary_messages", "summary_bytes", "summary_snapshots", "summary_bases_put")
# Where the fetches' seconds went (since 269ab21; absent before, and then left out, not "missing"):
# the receivers' call to the owner and import, the owners' wait for their cache lock and copy,
# and (later still) the owners' wait for their own prefill of the asked prefix.
PHASE_COUNTERS = ("fetch_call_seconds", "fetch_import_seconds", "fetch_export_wait_seconds",
                  "fetch_export_copy_seconds", "fetch_export_wait_prefill_seconds")
# Counts newer than the run figures above: absent from older builds, then None, not "missing".
LATER_COUNTERS = ("fetch_outwaited", "fetch_export_waits")
FALLBACK_PREFIX = "fetch_fallback_"
# Point-in-time estimates (not counters): taken from the snapshot after the run.
GAUGES = ("fetch_bandwidth_bytes_per_s", "fetch_overhead_s", "prefill_s_per_token", "fetch_enabled",
          "fetch_token_cost", "fetch_overhead_tokens")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def replica_deltas(before: dict, after: dict) -> dict[str, dict]:
    """Per replica id in both snapshots: each counter's increase (and each
    ``fetch_fallback_<reason>``'s), plus the gauges as ``after`` has them."""
    start, end = before.get("replicas", {}), after.get("replicas", {})
    deltas = {}
    for replica_id in sorted(set(start) & set(end)):
        first, last = start[replica_id], end[replica_id]
        keys = [*COUNTERS, *PHASE_COUNTERS, *LATER_COUNTERS, *sorted(k for k in last if k.startswith(FALLBACK_PREFIX))]
        row = {key: last[key] - first[key] for key in keys
               if _is_number(last.get(key)) and _is_number(first.get(key))}
        row.update({key: last[key] for key in GAUGES if key in last})
        deltas[replica_id] = row
    return deltas


def run_counters(before: dict, after: dict) -> dict:
    """The run's totals over the replicas in both snapshots.

    ``computed_prompt_tokens``: prompt positions run through the model
    (``prefill_tokens``); ``fetched_tokens``: positions imported from another
    replica's bundle; ``reused_local_tokens``: positions reused that were
    not just fetched (``tokens_saved - fetched_tokens``; a fetched prefix is
    then reused like any cached one). ``fetch_bandwidth_bytes_per_s``: the
    run's fetched bytes ÷ the fetches' wall time (round trip, owner's copy
    and import included); ``estimated_bandwidth_bytes_per_s`` /
    ``estimated_overhead_s``: each replica's own transfer model after the
    run (start-up probe, refined by fetches); ``reported_fetch_costs``:
    what each reported a fetch costs it (``[per token, fixed]`` in prefill
    tokens, ``CacheSummary.fetch_token_cost`` / ``fetch_overhead_tokens``). ``num_joined``: hinted
    requests that waited on a fetch already under way for the same prefix;
    ``num_outwaited``: hinted requests that stopped waiting for their fetch
    after their estimated recompute time and recomputed; ``num_export_waits``:
    exports that waited for the owner's own prefill of the asked prefix;
    ``num_hints`` / ``num_hints_ignored``: fetch hints the replicas received
    and ignored (fetch off, the hint named themselves, prefix held already).
    ``None`` where the replicas report no such figure.
    """
    deltas = replica_deltas(before, after)
    start, end = set(before.get("replicas", {})), set(after.get("replicas", {}))

    def total(key: str):
        values = [row[key] for row in deltas.values() if key in row]
        return sum(values) if values else None

    totals = {key: total(key) for key in COUNTERS}
    fallback_keys = sorted({k for row in deltas.values() for k in row if k.startswith(FALLBACK_PREFIX)})
    fallbacks = {k[len(FALLBACK_PREFIX):]: total(k) for k in fallback_keys}
    fetched, saved = totals["fetch_tokens"], totals["tokens_saved"]
    fetch_s, fetch_bytes = totals["fetch_seconds"], totals["fetch_bytes"]
    return {
        "computed_prompt_tokens": totals["prefill_tokens"],
        "fetched_tokens": fetched,
        "reused_local_tokens": None if saved is None else saved - (fetched or 0),
        "num_fetches": totals["fetch_count"],
        "num_joined": totals["fetch_joined"],
        "num_outwaited": total("fetch_outwaited"),  # since the fetch patience; None from older builds
        "num_hints": totals["fetch_hints"],
        "num_hints_ignored": totals["fetch_hints_ignored"],
        "num_exports": totals["fetch_exports"],
        "num_export_waits": total("fetch_export_waits"),  # exports that waited for the owner's prefill; None before
        "fetched_bytes": fetch_bytes,
        "fetch_seconds": fetch_s,
        "fetch_bandwidth_bytes_per_s": fetch_bytes / fetch_s if fetch_s and fetch_bytes is not None else None,
        "num_fallbacks": sum(fallbacks.values()) if fallbacks else None,
        "fallbacks": {reason: n for reason, n in fallbacks.items() if n},
        "fetch_phase_seconds": {key: value for key in PHASE_COUNTERS if (value := total(key)) is not None},
        "estimated_bandwidth_bytes_per_s": {r: row["fetch_bandwidth_bytes_per_s"] for r, row in deltas.items()
                                            if _is_number(row.get("fetch_bandwidth_bytes_per_s"))},
        "estimated_overhead_s": {r: row["fetch_overhead_s"] for r, row in deltas.items()
                                 if _is_number(row.get("fetch_overhead_s"))},
        # what each replica reported a fetch costs it (prefill tokens per token, fixed), for the router
        "reported_fetch_costs": {r: [row["fetch_token_cost"], row.get("fetch_overhead_tokens", 0.0)]
                                 for r, row in deltas.items() if _is_number(row.get("fetch_token_cost"))},
        "fetch_enabled": sorted({row["fetch_enabled"] for row in deltas.values() if "fetch_enabled" in row}),
        **_summary_figures(totals),
        "per_replica": deltas,
        "missing": sorted(key for key, value in totals.items() if value is None),
        "replicas_not_in_both": sorted(start ^ end),
    }


SUMMARY_TOTALS = ("summary_messages", "summary_bytes", "summary_snapshots", "summary_bases_put")


def _summary_figures(totals: dict) -> dict:
    """The routing summaries the replicas sent (issue 14, item 5): counts, and
    wire bytes per summary (÷ the routing-stats period: bytes/s per replica)."""
    figures = {key: totals.get(key) for key in SUMMARY_TOTALS}
    messages, sent = figures["summary_messages"], figures["summary_bytes"]
    figures["summary_bytes_per_message"] = sent / messages if messages and sent is not None else None
    return figures


def pool_counters(runs: list[dict]) -> dict:
    """Several runs' :func:`run_counters` as one: counts summed (``None`` if
    no run had the figure), the fetch bandwidth over all fetched bytes and
    fetch seconds, each run's estimates kept in order."""

    def total(key: str):
        values = [run[key] for run in runs if run.get(key) is not None]
        return sum(values) if values else None

    keys = ("computed_prompt_tokens", "fetched_tokens", "reused_local_tokens", "num_hints", "num_hints_ignored",
            "num_fetches", "num_joined", "num_outwaited", "num_exports", "num_export_waits",
            "fetched_bytes", "fetch_seconds", "num_fallbacks", *SUMMARY_TOTALS)
    pooled = {key: total(key) for key in keys}
    pooled.update(_summary_figures(pooled))
    fallbacks: dict[str, int] = {}
    for run in runs:
        for reason, count in run.get("fallbacks", {}).items():
            fallbacks[reason] = fallbacks.get(reason, 0) + count
    fetch_s, fetch_bytes = pooled["fetch_seconds"], pooled["fetched_bytes"]
    pooled["fetch_bandwidth_bytes_per_s"] = fetch_bytes / fetch_s if fetch_s and fetch_bytes is not None else None
    pooled["fallbacks"] = fallbacks
    phases: dict[str, float] = {}
    for run in runs:
        for key, seconds in run.get("fetch_phase_seconds", {}).items():
            phases[key] = phases.get(key, 0.0) + seconds
    pooled["fetch_phase_seconds"] = phases
    pooled["estimated_bandwidth_bytes_per_s"] = [sorted(run.get("estimated_bandwidth_bytes_per_s", {}).values())
                                                 for run in runs]
    pooled["estimated_overhead_s"] = [sorted(run.get("estimated_overhead_s", {}).values()) for run in runs]
    pooled["fetch_enabled"] = sorted({flag for run in runs for flag in run.get("fetch_enabled", [])})
    return pooled
