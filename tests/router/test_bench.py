"""router.bench: the decision-cost benchmark times the states it names."""

import pytest

from router import bench
from router import policy as policy_module
from router.policy_scoring_terms import ScoringTermsMixin
from router.work_left import WorkLeft


@pytest.mark.parametrize("fifo_full", [False, True])
def test_the_fifo_full_bench_times_decisions_with_the_turnover_term_in_force(monkeypatch, fifo_full):
    """``--fifo-full``: the replicas report full caches, one request running
    and one waiting, and prefill counters, so every timed decision prices
    the turnover term; the default bench never reaches it (no budget, no
    counters)."""
    prices = []
    original = ScoringTermsMixin._turnover_price

    def recorded(self, now):
        prices.append(original(self, now))
        return prices[-1]
    monkeypatch.setattr(ScoringTermsMixin, "_turnover_price", recorded)
    requests = bench._requests(400, 512, 64, seed=0)  # noqa: SLF001
    figures = bench.bench_fleet(4, requests, 200, 64, fifo_full=fifo_full)
    assert len(prices) == 400 and figures["decision_us_p50"] > 0
    timed = prices[200:]
    assert all(price is not None for price in timed) if fifo_full else all(price is None for price in timed)
    # --fifo-full: every replica reports its cache each summary_every decisions, timed apart
    assert (figures["periodic_summary_us_p50"] > 0) if fifo_full else figures["periodic_summary_us_p50"] is None


def test_fifo_full_summaries_keep_the_index_at_the_caches_size(monkeypatch):
    """Between two summaries a learn may leave the index past a cache's size
    (its slack); each periodic summary, a delta as a live Worker sends it,
    trims it back."""
    from router.prefix_index import PrefixIndex
    over_before, within_after, deltas = [], [], []

    def recording(name):
        original = getattr(PrefixIndex, name)

        def recorded(self, replica_id, *args, **kwargs):
            over_before.append(self.num_blocks(replica_id) > self.capacity_blocks(replica_id))
            original(self, replica_id, *args, **kwargs)
            within_after.append(self.num_blocks(replica_id) <= self.capacity_blocks(replica_id))
            deltas.append(name == "apply_delta")
        monkeypatch.setattr(PrefixIndex, name, recorded)
    recording("apply_summary")
    recording("apply_delta")
    requests = bench._requests(400, 512, 64, seed=0)  # noqa: SLF001
    bench.bench_fleet(4, requests, 200, 64, fifo_full=True, summary_every=50)
    assert len(within_after) == 4 * 2 + 15 + 1  # two warm-up reports each; 15 in 199 decisions (each replica every 50); the last
    assert all(within_after) and any(over_before)
    assert sum(deltas[8:-1]) == 15  # the periodic ones are deltas


def test_repeated_runs_time_the_same_decisions_and_their_fastest_p99_is_the_lower(monkeypatch):
    """``repeats``: each run is a new policy making the same decisions; the
    p99 of each decision's fastest run never exceeds the pooled p99 (every
    pooled time is at least its decision's fastest)."""
    from router.policy import PrefixAffinityPolicy
    chosen = []
    original = PrefixAffinityPolicy.on_routed

    def recorded(self, request, replica_id, request_id):
        chosen.append(replica_id)
        return original(self, request, replica_id, request_id)
    monkeypatch.setattr(PrefixAffinityPolicy, "on_routed", recorded)
    requests = bench._requests(300, 512, 64, seed=1)  # noqa: SLF001
    figures = bench.bench_fleet(4, requests, 150, 64, repeats=3)
    assert figures["repeats"] == 3 and len(chosen) == 900
    assert chosen[:300] == chosen[300:600] == chosen[600:]
    assert 0 < figures["decision_us_p99_fastest"] <= figures["decision_us_p99"]


@pytest.mark.parametrize("state", ["default", "fifo_full", "fifo_room"])
def test_the_fifo_room_bench_prices_running_requests_at_what_they_have_left(monkeypatch, state):
    """``--fifo-room``: FIFO replicas whose caches have room report work
    counters and output quantiles, so every timed decision prices a
    replica's running request at what it has left (``fifo_work_left``,
    :meth:`WorkLeft.view`), with summaries arriving between decisions
    (each moves the pooled quantiles); the other states never take that
    path (no quantiles; full caches)."""
    calls = []
    original = WorkLeft.view

    def recorded(self, *args):
        left = original(self, *args)

        def counted(*left_args):
            calls.append(len(calls))
            return left(*left_args)
        return counted
    monkeypatch.setattr(WorkLeft, "view", recorded)
    requests = bench._requests(400, 512, 64, seed=0)  # noqa: SLF001
    decided = []  # running requests priced before each decision
    original_rank = bench.PrefixAffinityPolicy.rank

    def rank(self, request, *args, **kwargs):
        decided.append(len(calls))
        return original_rank(self, request, *args, **kwargs)
    monkeypatch.setattr(bench.PrefixAffinityPolicy, "rank", rank)
    figures = bench.bench_fleet(4, requests, 200, 64, fifo_full=state == "fifo_full", summary_every=50,
                                fifo_room=state == "fifo_room")
    if state == "fifo_room":
        per_decision = [b - a for a, b in zip(decided[200:], decided[201:] + [len(calls)])]
        assert len(per_decision) == 200 and min(per_decision) >= 1  # every timed decision prices a running request
        assert figures["periodic_summary_us_p50"] > 0
    else:
        assert not calls


def test_the_cold_bench_times_cold_prompts_with_every_ring_node_in_reach(monkeypatch):
    """``--cold``: prompts share nothing (the grouped ones share 64 first
    blocks), so in ``--fifo-room`` every timed decision is a cold prompt's
    behind the room gate, whose candidates are ``num_cold_candidates`` ring
    nodes (all 4 here), not 2 and the least loaded."""
    rooms = []
    original = bench.PrefixAffinityPolicy._placement_evicts_nothing  # noqa: SLF001

    def recorded(self, request):
        rooms.append(original(self, request))
        return rooms[-1]
    monkeypatch.setattr(bench.PrefixAffinityPolicy, "_placement_evicts_nothing", recorded)
    cold = bench._requests(400, 512, 64, seed=0, cold=True)  # noqa: SLF001
    assert len({r.block_hashes[0] for r in cold}) == 400  # nothing shared
    grouped = bench._requests(400, 512, 64, seed=0)  # noqa: SLF001
    assert len({r.block_hashes[0] for r in grouped}) <= 64
    candidates = []
    original_gather = policy_module.gather

    def gather(*args, **kwargs):
        found = original_gather(*args, **kwargs)
        candidates.append((not found.depths, len(found.replica_ids)))
        return found
    monkeypatch.setattr(policy_module, "gather", gather)
    bench.bench_fleet(4, cold, 200, 64, summary_every=50, fifo_room=True)
    assert rooms.count(True) >= 200  # the timed decisions are behind the gate
    timed = candidates[-200:]
    assert all(is_cold and width == 4 for is_cold, width in timed)
