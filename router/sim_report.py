"""What a simulated replay reports: its figures, and the comparison plot."""

from __future__ import annotations

from harness.loadstats import percentile
from router.workload import Workload


def replay_figures(workload: Workload, config, replicas: list, decision_us: list[float]) -> dict:
    """Hit rates, load imbalance (max / mean busy time; ``prompt_imbalance``: of
    prompt tokens, as the load test measures it), TTFT percentiles, queueing
    delay (TTFT less the request's own prefill alone) and the p99 of that
    prefill alone (``own_prefill_p99_s``), decision cost, the
    prompt tokens each replica computed (``computed_tokens``: its cache's
    turnover, summing to the misses); fetches
    (tokens fetched count as hits; ``fetched_rate`` is their share of prompt
    tokens) and fetch hints that fell back to recompute."""
    outcomes = {}
    for replica in replicas:
        outcomes.update(replica.outcomes)
    timing = config.timing
    cached_total = prompt_total = num_hits = elsewhere_total = 0
    ttfts, waits, owns = [], [], []
    for number, request in enumerate(workload.requests):
        outcome = outcomes[number]
        cached_total += outcome.cached_tokens
        elsewhere_total += outcome.held_elsewhere_tokens
        prompt_total += request.num_prompt_tokens
        num_hits += outcome.cached_tokens > 0
        ttfts.append(outcome.ttft_s)
        own_s = timing.prefill_s(request.num_prompt_tokens - outcome.cached_tokens, outcome.cached_tokens)
        waits.append(outcome.ttft_s - own_s)
        owns.append(own_s)
    ttfts.sort()
    waits.sort()
    decision_us.sort()
    busy = [r.busy_s for r in replicas]
    mean_busy = sum(busy) / len(busy)
    prompt = [sum(workload.requests[n].num_prompt_tokens for n in r.outcomes) for r in replicas]
    mean_prompt = sum(prompt) / len(prompt)
    computed = [total - sum(o.cached_tokens for o in r.outcomes.values()) for total, r in zip(prompt, replicas)]
    figures = {
        "hit_rate": cached_total / max(prompt_total, 1),
        "request_hit_rate": num_hits / max(len(ttfts), 1),
        # recomputed while another replica held them (the true caches at the time): hits a fleet whose caches
        # acted as one would have had; the rest of the gap to the global LRU is what the caches held
        "held_elsewhere_rate": elsewhere_total / max(prompt_total, 1),
        "load_imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
        # the load test's measure (harness.loadstats): max / mean prompt tokens sent to a replica
        "prompt_imbalance": max(prompt) / mean_prompt if mean_prompt > 0 else 1.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": sum(ttfts) / max(len(ttfts), 1),
        "wait_p99_s": percentile(waits, 99),
        # the TTFT p99 with every queue wait left out: each request's own prefill at the hits it got. What the
        # policy's cache placement alone allows; ttft_p99_s less this is what its queueing added
        "own_prefill_p99_s": percentile(owns, 99),
        "decision_us_p50": percentile(decision_us, 50),
        "decision_us_p99": percentile(decision_us, 99),
        "busy_s": busy,
        # prompt tokens each replica computed and inserted: its cache's turnover
        "computed_tokens": computed,
    }
    counts = [r.fetch_counts for r in replicas]
    num_fetched_tokens = sum(c.num_fetched_tokens for c in counts)
    figures.update({  # of the hits above, those fetched from another replica (issue 13)
        "fetched_tokens": num_fetched_tokens,
        "fetched_rate": num_fetched_tokens / max(prompt_total, 1),
        "num_fetches": sum(c.num_fetched for c in counts),
        "num_fetch_held": sum(c.num_held for c in counts),  # backup hints the receiver did not need
        "num_fetch_evicted": sum(c.num_evicted for c in counts),  # no replica named held more: recomputed
        "num_fetch_from_alternate": sum(c.num_from_alternate for c in counts),  # the owner had evicted it
        "num_fetch_slower": sum(c.num_slower for c in counts),  # recomputing was cheaper: recomputed
        "num_fetch_outwaited": sum(c.num_outwaited for c in counts),  # the owner's prefill ended too late
        "num_fetch_waited": sum(c.num_waited for c in counts),  # fetched once the owner's prefill computed it
        "export_busy_s": sum(c.export_busy_s for c in counts),
    })
    if getattr(config, "closed_loop", None) is not None:  # a live comparison: small, and it needs the samples
        figures["ttft_samples_s"] = ttfts
    if config.replica_model == "cb":
        num_steps = sum(r.num_steps for r in replicas)
        decode_tokens = sum(r.num_output_tokens for r in workload.requests)
        figures["mean_decode_batch"] = decode_tokens / max(num_steps, 1)
        figures["num_preemptions"] = sum(r.num_preemptions for r in replicas)
    return figures


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    figures = result["policies"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    positions = range(len(names))
    axes[0].bar(positions, [figures[n]["hit_rate"] for n in names], color="tab:blue")
    axes[0].axhline(result["global_lru_hit_rate"], color="tab:green", ls="--", label="global LRU")
    axes[0].axhline(result["infinite_hit_rate"], color="tab:gray", ls=":", label="infinite cache")
    axes[0].set_title("token hit rate")
    axes[0].legend(loc="lower right")
    width = 0.4
    axes[1].bar([p - width / 2 for p in positions], [figures[n]["ttft_p50_s"] for n in names], width, label="p50")
    axes[1].bar([p + width / 2 for p in positions], [figures[n]["ttft_p99_s"] for n in names], width, label="p99")
    if "ttft_p99_floor_s" in result:
        axes[1].axhline(result["ttft_p99_floor_s"], color="tab:red", ls="--", label="p99 floor (any policy)")
    axes[1].set_yscale("log")
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    axes[2].bar(positions, [figures[n]["load_imbalance"] for n in names], color="tab:orange")
    axes[2].axhline(1.10, color="tab:red", ls="--", label="goal 1.10")
    axes[2].set_ylim(bottom=1.0)
    axes[2].set_title("load imbalance (max / mean work)")
    axes[2].legend()
    for axis in axes:
        axis.set_xticks(list(positions))
        axis.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    setup = result["setup"]
    fig.suptitle(
        f"{setup['workload']}: {setup['num_replicas']} replicas × {setup['budget_tokens']:,} tokens, "
        f"prefill {setup['prefill_tokens_per_s']:,.0f} tok/s, decode {setup['decode_s_per_token']} s/token, "
        f"no-hit utilisation {setup['utilisation']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
