"""The table ``python -m router.simulate`` prints: the setup, the cache
bounds, and one line per policy (hit rate, imbalance, TTFT, queueing, decision
cost, decode batch; summary traffic where measured)."""

from __future__ import annotations


def print_table(result: dict) -> None:
    """Print :func:`router.simulate.simulate`'s ``result`` to stdout."""
    setup = result["setup"]
    speed = (f"fifo: prefill {setup['prefill_tokens_per_s']:,.0f} tok/s, decode {setup['decode_s_per_token']} s/token"
             if setup["replica_model"] == "fifo" else
             f"cb {setup['profile']['name']}: step {setup['profile']['base_s']*1e3:g} ms "
             f"+ {setup['profile']['prefill_token_s']*1e6:g} us/prefill token "
             f"+ {setup['profile']['decode_seq_s']*1e6:g} us/decode "
             f"+ {setup['profile']['context_token_s']*1e9:g} ns/context token")
    print(f"{speed}; arrivals x{setup['arrival_scale']:.3f}; max_tokens {setup['max_tokens']}")
    one_cache = (f", under the replicas' eviction (protected share {setup['cache_protected_share']:g}) "
                 f"{result['global_cache_hit_rate']:.4f}" if setup.get("cache_protected_share") else "")
    print(f"one cache of the fleet's budget: LRU hit rate {result['global_lru_hit_rate']:.4f}{one_cache}; "
          f"infinite {result['infinite_hit_rate']:.4f}, TTFT p99 floor {result['ttft_p99_floor_s']:.3f} s")
    print(f"{'policy':>20} {'hit':>7} {'imbal':>6} {'p50 s':>7} {'p99 s':>7} {'wait p99':>8} {'dec p99 us':>10}"
          f" {'batch':>6}")
    for name, f in result["policies"].items():
        print(f"{name:>20} {f['hit_rate']:7.4f} {f['load_imbalance']:6.3f} {f['ttft_p50_s']:7.3f}"
              f" {f['ttft_p99_s']:7.3f} {f['wait_p99_s']:8.3f} {f['decision_us_p99']:10.1f}"
              f" {f.get('mean_decode_batch', 1.0):6.2f}")
        if "global_lru_hit_rate_as_sent" in f:
            print(f"{'':>20} one cache of the fleet's budget, in the order its closed loop sent: LRU hit rate "
                  f"{f['global_lru_hit_rate_as_sent']:.4f}, under the replicas' eviction "
                  f"{f['global_cache_hit_rate_as_sent']:.4f}")
        if "held_elsewhere_rate" in f:
            print(f"{'':>20} recomputed while another replica held them: {f['held_elsewhere_rate']:.4f} of prompt "
                  f"tokens")
        if f.get("num_fetch_hints"):
            print(f"{'':>20} fetch: {f['num_fetch_hints']:.0f} hints, {f['num_fetches']:.0f} fetched "
                  f"({f['fetched_rate']:.4f} of prompt tokens; {f.get('num_fetch_from_alternate', 0):.0f} from an "
                  f"alternate), {f.get('num_fetch_held', 0):.0f} already held, "
                  f"{f['num_fetch_evicted']:.0f} evicted by every replica named, "
                  f"{f['num_fetch_slower']:.0f} recompute faster; owners' export {f['export_busy_s']:.2f} s")
        if "summary_bytes_per_replica_s" in f:
            print(f"{'':>20} summaries ({setup['summary_mode']}): {f['summary_bytes_per_replica_s']:,.0f} B/s per "
                  f"replica; router {f['router_summary_cpu_ms_per_s']:.2f} ms CPU per s applying them")
