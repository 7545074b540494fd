"""router.cache_turnover: the tokens written into each replica's cache lately."""

import math
import random

import pytest

from cache.summary import CacheSummary
from router.cache_turnover import CacheTurnover
from router.policy import PolicyConfig, PrefixAffinityPolicy
from tests.router.fake_clock import Clock
from tests.router.test_fetch import BLOCK, REPLICAS, request


def _reported(turnover: CacheTurnover, counters: dict[str, tuple[int, int]], now: float, epoch: str = "e") -> None:
    for replica_id, (prefill, output) in counters.items():
        turnover.report(replica_id, epoch, prefill, output, now)


def test_relative_is_each_replicas_written_tokens_against_the_fleets_mean():
    turnover = CacheTurnover(window_s=100.0)
    _reported(turnover, {"a": (0, 0), "b": (0, 0)}, now=0.0)
    assert turnover.relative(2, 0.0) is None  # nothing written yet
    _reported(turnover, {"a": (3000, 0), "b": (500, 500)}, now=10.0)  # prompt and generated tokens both count
    relative = turnover.relative(2, 10.0)
    assert relative("a") == pytest.approx(3000 / 2000 - 1)
    assert relative("b") == pytest.approx(1000 / 2000 - 1)
    assert relative("unknown") == 0.0
    turnover.check_invariants()


def test_it_waits_for_every_replica_to_report():
    turnover = CacheTurnover(window_s=100.0)
    _reported(turnover, {"a": (0, 0)}, now=0.0)
    _reported(turnover, {"a": (1000, 0)}, now=1.0)
    assert turnover.relative(2, 1.0) is None
    assert turnover.relative(1, 1.0)("a") == pytest.approx(0.0)


def test_old_writes_decay_so_recent_ones_decide():
    turnover = CacheTurnover(window_s=10.0)
    _reported(turnover, {"a": (0, 0), "b": (0, 0)}, now=0.0)
    _reported(turnover, {"a": (10_000, 0), "b": (0, 0)}, now=1.0)  # a written long ago
    _reported(turnover, {"a": (10_000, 0), "b": (1000, 0)}, now=61.0)  # b just now
    relative = turnover.relative(2, 61.0)
    a_now, b_now = 10_000 * math.exp(-6.0), 1000.0
    assert relative("a") == pytest.approx(a_now / ((a_now + b_now) / 2) - 1)
    assert relative("b") > 0 > relative("a")
    turnover.check_invariants()


def test_this_routers_sends_count_until_the_replica_reports_them():
    turnover = CacheTurnover(window_s=100.0)
    _reported(turnover, {"a": (1000, 0), "b": (1000, 0)}, now=0.0)
    _reported(turnover, {"a": (2000, 0), "b": (2000, 0)}, now=1.0)
    turnover.on_routed("a", 2000)
    relative = turnover.relative(2, 1.0)
    assert relative("a") > 0 > relative("b")
    _reported(turnover, {"a": (4000, 0)}, now=1.0)  # its report now shows those 2000 tokens: not counted twice
    assert turnover.relative(2, 1.0)("a") == pytest.approx(3000 / 2000 - 1)
    turnover.check_invariants()


def test_a_restarted_replica_starts_at_the_others_mean():
    turnover = CacheTurnover(window_s=100.0)
    _reported(turnover, {"a": (0, 0), "b": (0, 0), "c": (0, 0)}, now=0.0)
    _reported(turnover, {"a": (9000, 0), "b": (3000, 0), "c": (3000, 0)}, now=1.0)
    turnover.report("a", "new-epoch", 10, 0, now=2.0)  # restarted: its old writes are gone with its cache
    relative = turnover.relative(3, 2.0)
    assert relative("a") == pytest.approx(0.0)
    assert relative("b") == pytest.approx(relative("c"))
    turnover.report("b", "e", 100, 0, now=3.0)  # counters that went back: a restart too
    assert turnover.relative(3, 3.0)("b") == pytest.approx(0.0, abs=1e-9)
    turnover.check_invariants()


def test_removing_a_replica_drops_it_from_the_mean():
    turnover = CacheTurnover(window_s=100.0)
    _reported(turnover, {"a": (0, 0), "b": (0, 0), "c": (0, 0)}, now=0.0)
    _reported(turnover, {"a": (1000, 0), "b": (1000, 0), "c": (7000, 0)}, now=1.0)
    turnover.on_routed("c", 500)
    turnover.remove("c")
    assert len(turnover) == 2
    assert turnover.relative(2, 1.0)("a") == pytest.approx(0.0)
    turnover.check_invariants()


def test_a_long_run_rebases_without_overflow_or_drift():
    turnover = CacheTurnover(window_s=1.0)
    now = 0.0
    for step in range(1, 2000):  # ~4 moves of the base
        now = step * 0.1
        _reported(turnover, {"a": (step * 300, 0), "b": (step * 100, 0)}, now)
    relative = turnover.relative(2, now)
    assert relative("a") == pytest.approx(0.5, rel=1e-6)  # 3 : 1 written per step, at every time scale
    assert relative("b") == pytest.approx(-0.5, rel=1e-6)
    assert turnover._base.base_s > 150.0  # noqa: SLF001  (moved: stored values stay near their size)
    turnover.check_invariants()


def test_window_must_be_positive():
    with pytest.raises(ValueError):
        CacheTurnover(window_s=0.0)


# ------------------------------------------------------------------ in the policy
def fleet_reporting(turnover_weight: float, *, full: bool = True, running: int = 1,
                    written=(12000, 6000, 6000, 2000), **knobs) -> PrefixAffinityPolicy:
    """Four replicas, each reporting twice: caches full (or at 0 of their
    budget), ``running`` requests running and two waiting, and ``written`` prompt tokens
    prefilled between the two reports (replica-0 the most, above the mean;
    replica-3 the fewest; the other two a little below the mean). All four are
    candidates for every prompt (``num_ring_candidates`` 4): the term ranks
    the candidates, it does not add one."""
    clock = Clock()
    config = PolicyConfig(block_size=BLOCK, turnover_weight=turnover_weight, num_ring_candidates=4, **knobs)
    policy = PrefixAffinityPolicy(config, clock=clock)
    policy.set_replicas(REPLICAS)
    for version, share in ((1, 0), (2, 1)):
        clock.now += 1.0
        for replica_id, tokens in zip(REPLICAS, written):
            assert policy.on_summary(CacheSummary(
                replica_id, version, clock.now, BLOCK, frozenset(), num_cached_tokens=10_000 if full else 0,
                budget_tokens=10_000, num_running=running, num_waiting=2, num_prefill_tokens_total=share * tokens))
    return policy


def first_choices(policy_of) -> list[str]:
    """Each of 12 cold prompts' first choice, on a fresh fleet each."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10**6) for _ in range(40)] for _ in range(12)]
    return [policy_of().rank(request(tokens))[0] for tokens in prompts]


def test_a_cold_prompt_goes_where_a_full_fifo_cache_turns_over_slowest():
    """FIFO replicas (never two running, requests waiting), caches full: a
    cold prompt's tokens evict least where the cache is written slowest, so
    it goes to replica-3 whatever its ring home (not merely away from
    replica-0, the one above the mean: a cold prompt's write is priced
    below the mean too). Off (weight 0), with caches that have
    room (a write evicts nothing), or on batching replicas without
    ``batching_turnover_credit`` (the gate), the ring home decides as
    before; equal writes change nothing either."""
    assert PolicyConfig().turnover_weight == 4.0
    assert set(first_choices(lambda: fleet_reporting(4.0))) == {"replica-3"}
    before = first_choices(lambda: fleet_reporting(0.0))
    assert len(set(before)) > 1
    assert first_choices(lambda: fleet_reporting(4.0, full=False)) == before
    assert first_choices(lambda: fleet_reporting(4.0, running=2, batching_turnover_credit=False)) == before
    assert first_choices(lambda: fleet_reporting(4.0, written=(5000,) * 4)) == before


def test_at_a_batching_server_a_cold_prompt_gets_only_the_credit():
    """Batching replicas (seen running two), caches full: a cold prompt is
    credited where a cache turns over slower than the mean and goes to
    replica-3, the slowest (``batching_turnover_credit``, the default)."""
    assert PolicyConfig().batching_turnover_credit is True
    assert set(first_choices(lambda: fleet_reporting(4.0, running=2))) == {"replica-3"}


def test_at_a_batching_server_a_warm_prompt_pays_no_turnover_price():
    """replica-0 holds the first 8 tokens of a 64-token prompt and its cache
    turns over twice as fast as the mean. At FIFO servers the 56 tokens it
    would write there cost 4 x 1 each, more than its affinity for 8, and
    the prompt goes elsewhere; at batching servers the term prices no
    write, so it stays with its holder, as with the term off."""
    def first_choice(turnover_weight: float, running: int) -> str:
        policy = fleet_reporting(turnover_weight, running=running, written=(12000, 4000, 4000, 4000))
        held = [4242 + i for i in range(8)]
        assert policy.on_summary(CacheSummary(
            "replica-0", 3, 3.0, BLOCK, frozenset(request(held).block_hashes), num_cached_tokens=10_000,
            budget_tokens=10_000, num_running=running, num_waiting=2, num_prefill_tokens_total=12000))
        return policy.rank(request(held + [7 + i for i in range(56)]))[0]

    assert first_choice(0.0, running=2) == "replica-0"
    assert first_choice(4.0, running=1) != "replica-0"
    assert first_choice(4.0, running=2) == "replica-0"


def test_the_router_s_own_sends_fill_the_slow_cache_until_the_term_lets_go():
    """Sent there, the cold prompts count as written at replica-3 before it
    reports them (:meth:`CacheTurnover.on_routed`): it stops taking every
    one of them, and the policy's invariants hold throughout."""
    policy = fleet_reporting(4.0)
    rng = random.Random(1)
    chosen = []
    for i in range(60):
        cold = request([rng.randrange(10**6) for _ in range(40)])
        chosen.append(policy.decide(cold, request_id=str(i)).ranked[0])
        policy.on_routed(cold, chosen[-1], str(i))
        policy.check_invariants()
    assert chosen[0] == "replica-3" and len(set(chosen)) == 4


def test_a_warm_prompt_is_not_drawn_off_its_holder_by_a_slow_cache():
    """The turnover term rewards writing at a cache that churns slowly only
    for a cold prompt (no candidate holds any of it): a warm prompt's
    candidates that lack its prefix would write it all again, and a bonus
    for that would draw it off the replica holding it and leave a second
    copy (shared-prefix FIFO lost a system prompt in 2 of 40 seeds that
    way). A cache written faster than the mean still costs more. Here
    replica-0 churns a little faster than the mean and holds the first 24
    of a 64-token prompt: the prompt stays there (with a bonus at replica-3
    for the 64 tokens it would write, it went there); a cold one still goes
    to replica-3, the slowest."""
    policy = fleet_reporting(4.0, written=(9000, 8000, 8000, 2000))
    held = [4242 + i for i in range(24)]
    assert policy.on_summary(CacheSummary(
        "replica-0", 3, 3.0, BLOCK, frozenset(request(held).block_hashes), num_cached_tokens=10_000,
        budget_tokens=10_000, num_running=1, num_waiting=2, num_prefill_tokens_total=9000))
    assert policy.rank(request(held + [7 + i for i in range(40)]))[0] == "replica-0"
    assert policy.rank(request([10**6 + i for i in range(40)]))[0] == "replica-3"
