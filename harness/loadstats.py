"""Per-request records of a load test and their summary (pure).

Cluster hit rate is token-level: cached prompt tokens / prompt tokens, as the
servers report them (``cached_tokens`` of each response).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    session_id: int
    turn: int
    prompt_tokens: int
    start_s: float
    end_s: float = 0.0
    status: int = 200
    error: str | None = None
    replica_id: str | None = None
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    server_ttft_s: float | None = None  # the engine's own, from its submission (the done event's ttft_s)
    server_queue_s: float | None = None  # of that, waiting before a step took it (the done event's queue_s)

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))  # 1-based: the smallest value with q% at or below it
    return ordered[min(len(ordered), max(1, rank)) - 1]


def _dist(values: list[float]) -> dict:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {
        "mean": sum(values) / len(values) if values else None
    }


def request_log(records: list[RequestRecord]) -> list[list]:
    """One row per answered request in send order: ``[session, turn,
    replica, sent s (from the run's first send), TTFT s, cached tokens,
    prompt tokens, engine TTFT s, engine queue s]`` — where each request
    went, what it found there and how much of its wait was the engine's
    (and of that, waiting for a step), for tracing a run's placement
    decisions after the fact."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.start_s)
    t0 = ok[0].start_s if ok else 0.0
    return [[r.session_id, r.turn, r.replica_id, round(r.start_s - t0, 4), _rounded(r.ttft_s), r.cached_tokens,
             r.prompt_tokens, _rounded(r.server_ttft_s), _rounded(r.server_queue_s)] for r in ok]


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def busy_s(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` spans: how long a replica had
    at least one request in flight (O(n log n))."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(records: list[RequestRecord], wall_s: float, slo: dict, num_replicas: int | None = None) -> dict:
    """Figures of one run. ``num_replicas`` (when known) counts replicas that
    served nothing in the load imbalance: all traffic on one of two replicas
    is imbalance 2.0, not 1.0. ``load_imbalance`` is of prompt tokens sent;
    ``busy_imbalance`` of each replica's busy time as the client saw it (the
    union of its requests' spans, sent to last byte), the simulator's
    measure."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itl_s]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = [
        r for r in ok
        if r.ttft_s is not None and r.ttft_s <= slo["ttft_s"]
        and (not r.itl_s or max(r.itl_s) <= slo["itl_s"])
    ]
    overheads = [r.ttft_s - r.server_ttft_s for r in ok if r.ttft_s is not None and r.server_ttft_s is not None]
    per_replica_requests = Counter(r.replica_id for r in ok)
    per_replica_cached = Counter()
    per_replica_prompt = Counter()
    for r in ok:
        per_replica_cached[r.replica_id] += r.cached_tokens
        per_replica_prompt[r.replica_id] += r.prompt_tokens
    per_replica_pace: dict = {}  # each request's decode pace: (latency - TTFT) / (output tokens - 1)
    per_replica_sessions: dict = {}
    for r in ok:
        per_replica_sessions.setdefault(r.replica_id, set()).add(r.session_id)
        if r.ttft_s is not None and r.output_tokens > 1:
            per_replica_pace.setdefault(r.replica_id, []).append((r.latency_s - r.ttft_s) / (r.output_tokens - 1))
    loads = list(per_replica_prompt.values())
    spans: dict = {}
    for r in ok:
        spans.setdefault(r.replica_id, []).append((r.start_s, r.end_s))
    busy = [busy_s(replica_spans) for replica_spans in spans.values()]
    if num_replicas is not None:
        loads += [0] * max(0, num_replicas - len(loads))
        busy += [0.0] * max(0, num_replicas - len(busy))
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "errors": dict(Counter(r.status for r in records if not r.ok)),
        "wall_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": output_tokens / wall_s if wall_s else 0.0,
        "goodput_rps": len(good) / wall_s if wall_s else 0.0,
        "ttft_s": _dist(ttfts),
        # client TTFT less the engine's: HTTP proxy, ingress, routing, the Ray call, streaming back
        "server_ttft_s": _dist([r.server_ttft_s for r in ok if r.server_ttft_s is not None]),
        # of the engine's TTFT, the wait before a step took the request (the rest is its prefill)
        "server_queue_s": _dist([r.server_queue_s for r in ok if r.server_queue_s is not None]),
        "ingress_overhead_s": _dist(overheads),
        "ingress_overhead_samples_s": [round(x, 5) for x in sorted(overheads)],  # for a simulator to draw from
        "itl_samples_s": [round(x, 5) for x in sorted(itls)],  # each gap is one engine step, as the client saw it
        "itl_s": _dist(itls),
        "latency_s": _dist([r.latency_s for r in ok]),
        "cluster_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "request_hit_rate": sum(1 for r in ok if r.cached_tokens > 0) / len(ok) if ok else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "per_replica": {
            str(replica): {
                "requests": per_replica_requests[replica],
                "prompt_tokens": per_replica_prompt[replica],
                "hit_rate": per_replica_cached[replica] / per_replica_prompt[replica] if per_replica_prompt[replica] else 0.0,
                "sessions": len(per_replica_sessions[replica]),  # sessions with a request served here
                "decode_s_per_token_p50": percentile(per_replica_pace.get(replica, []), 50),
            }
            for replica in sorted(per_replica_requests, key=str)
        },
        "load_imbalance": max(loads) / (sum(loads) / len(loads)) if loads else None,
        "busy_imbalance": max(busy) / (sum(busy) / len(busy)) if busy and sum(busy) > 0 else None,
    }
