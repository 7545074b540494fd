"""Cold-prefix homing that independent routers agree on (router.cold_home),
and the router-share estimate (router.router_share)."""

import dataclasses

import pytest

from cache import block_hashes
from cache.summary import CacheSummary
from router import PolicyConfig, PrefixAffinityPolicy, RoutingRequest
from router.cold_home import cold_home
from router.ring import HashRing
from router.router_share import RouterShare
from tests.router.fake_clock import Clock

BLOCK = 4
REPLICAS = [f"replica-{i}" for i in range(8)]


def make_policy(clock, **config):
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, **config), clock=clock)
    policy.set_replicas(REPLICAS)
    return policy


def request(seed, num_tokens=32, num_output_tokens=16):
    tokens = [seed * 1000 + i for i in range(num_tokens)]
    return RoutingRequest(tuple(block_hashes(tokens, BLOCK)), len(tokens), None, "", num_output_tokens)


def report(policy, replica_id, version, queued=0, output_total=0):
    policy.on_summary(CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), 0, 10_000,
                                   num_queued_tokens=queued, num_output_tokens_total=output_total,
                                   mean_output_tokens=16.0 if output_total else 0.0))


def give_history(policy, clock, seeds, target=None):
    """Route (and never complete) requests, so this router's own loads and
    recent work differ from a fresh router's."""
    for seed in seeds:
        clock.now += 0.01
        req = request(seed)
        chosen = target or policy.rank(req)[0]
        policy.on_routed(req, chosen, f"h{seed}")


@pytest.mark.parametrize("mode", ["ring", "bounded", "least_of_two"])
def test_routers_with_different_histories_home_a_cold_prefix_alike(mode):
    """Their own loads and recent work differ; the ring and the summaries do not."""
    clock = Clock()
    busy, fresh = make_policy(clock, cold_home=mode), make_policy(clock, cold_home=mode)
    give_history(busy, clock, range(500, 540), target="replica-3")  # all on one replica: skewed loads
    give_history(busy, clock, range(600, 640))
    for policy in (busy, fresh):  # the same summaries reach both (the history is older than them)
        for version, replica_id in enumerate(REPLICAS, 1):
            report(policy, replica_id, version, queued=50 if replica_id == "replica-3" else 0)
    for seed in range(64):
        req = request(seed)
        assert busy.rank(req)[0] == fresh.rank(req)[0], seed
        busy.check_invariants()


def test_the_cost_rule_lets_such_histories_disagree():
    """What the new rule fixes: by default a router's own queue decides a cold home."""
    clock = Clock()
    busy, fresh = make_policy(clock), make_policy(clock)
    give_history(busy, clock, range(500, 540), target="replica-3")
    disagree = sum(busy.rank(request(seed))[0] != fresh.rank(request(seed))[0] for seed in range(64))
    assert disagree > 0


@pytest.mark.parametrize("mode", ["ring", "bounded", "least_of_two"])
def test_cold_homes_spread_over_the_fleet(mode):
    clock = Clock()
    policy = make_policy(clock, cold_home=mode)
    homes = [policy.rank(request(seed))[0] for seed in range(256)]
    counts = [homes.count(r) for r in REPLICAS]
    assert min(counts) > 0 and max(counts) <= 2 * 256 / len(REPLICAS), counts


def test_bounded_homes_skip_a_replica_the_summaries_show_overloaded():
    clock = Clock()
    a, b = make_policy(clock, cold_home="bounded"), make_policy(clock, cold_home="bounded")
    give_history(a, clock, range(500, 520))  # a different history on a only
    for policy in (a, b):
        for version, replica_id in enumerate(REPLICAS, 1):
            report(policy, replica_id, version, queued=100_000 if replica_id == "replica-0" else 0)
    moved = 0
    for seed in range(64):
        req = request(seed)
        home = a.ring.lookup(req.block_hashes[0])
        assert a.rank(req)[0] == b.rank(req)[0] != "replica-0"
        moved += home == "replica-0"
    assert moved > 0  # some of these prefixes' ring home was the overloaded replica


def test_a_warm_prefix_still_follows_its_cache():
    clock = Clock()
    policy = make_policy(clock, cold_home="bounded")
    req = request(7)
    policy.on_routed(req, "replica-5", "q0")  # not its ring home (unless by chance): the index holds it
    policy.on_completed("q0")
    assert policy.rank(request(7, num_tokens=40))[0] == "replica-5"


def test_cold_home_function():
    ring = HashRing(REPLICAS)
    key = 12345
    walk = list(ring.walk(key))
    loads = {r: 0.0 for r in REPLICAS}
    assert cold_home("cost", ring, key, REPLICAS, loads.get, 0.0, 1.25, 1.0) is None
    assert cold_home("ring", ring, key, REPLICAS, loads.get, 0.0, 1.25, 1.0) == walk[0]
    loads[walk[0]] = 100.0
    assert cold_home("least_of_two", ring, key, REPLICAS, loads.get, 0.0, 1.25, 1.0) == walk[1]
    assert cold_home("bounded", ring, key, REPLICAS, loads.get, 100 / 8, 1.25, 1.0) == walk[1]
    assert cold_home("bounded", ring, key, set(walk[2:]), loads.get, 100 / 8, 1.25, 1.0) == walk[2]


def test_router_share_reads_the_number_of_routers():
    share = RouterShare(window_s=120.0)
    assert share.routers(0.0, 16.0) == 1.0  # nothing seen
    for replica_id in REPLICAS:
        share.on_report(replica_id, "e", 0, 0.0)
    for i in range(32):  # this router completed 32 requests of ~16 output tokens
        share.on_completed(0.1 * i)
    for replica_id in REPLICAS:  # the fleet made 4x that
        share.on_report(replica_id, "e", 4 * 32 * 16 // len(REPLICAS), 3.2)
    assert share.routers(3.2, 16.0) == pytest.approx(4.0, rel=0.05)
    share.on_report("replica-0", "restarted", 0, 3.3)  # a new epoch adds nothing
    assert share.routers(3.3, 16.0) == pytest.approx(4.0, rel=0.05)


def test_router_share_reads_one_router_as_one():
    share = RouterShare(window_s=120.0)
    share.on_report("replica-0", "e", 0, 0.0)
    for i in range(8):
        share.on_completed(0.1 * i)
    share.on_report("replica-0", "e", 8 * 16 * 3, 1.0)  # 3x, but under min_completions
    assert share.routers(1.0, 16.0) == 1.0
    for i in range(16):
        share.on_completed(1.0 + 0.1 * i)
    share.on_report("replica-0", "e", 500, 3.0)  # 500 / (24 x 16): ratio ~1.3 < 1.5, one router
    assert share.routers(3.0, 16.0) == 1.0


def test_config_checks_the_new_knobs():
    with pytest.raises(ValueError):
        PolicyConfig(cold_home="nearest")
    with pytest.raises(ValueError):
        PolicyConfig(cold_home_load_factor=0.5)
    with pytest.raises(ValueError):
        PolicyConfig(balance_fleet_scale=1)
    assert dataclasses.replace(PolicyConfig(), cold_home="bounded").cold_home == "bounded"


def _run_one_router(clock, policy, num_requests=200):
    """One router over a stream whose every completion it hears, with summaries
    that report exactly its own work: what it decides, in order."""
    chosen, outputs, in_flight = [], {r: 0 for r in REPLICAS}, []
    version = 0
    for number in range(num_requests):
        clock.now += 0.05
        req = request(number % 24, num_tokens=32 + 4 * (number % 5))
        replica_id = policy.decide(req, request_id=str(number)).ranked[0]
        policy.on_routed(req, replica_id, str(number))
        chosen.append(replica_id)
        in_flight.append((str(number), replica_id))
        if len(in_flight) > 6:
            done, done_at = in_flight.pop(0)
            policy.on_completed(done)
            outputs[done_at] += 16
        if number % 20 == 19:
            version += 1
            for replica_id in REPLICAS:
                policy.on_summary(CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), 0, 10_000,
                                               num_output_tokens_total=outputs[replica_id],
                                               mean_output_tokens=16.0))
    return chosen


def test_the_several_router_terms_change_nothing_for_one_router():
    """balance_fleet_scale / load_peer_estimate read one router as one (RouterShare),
    so a lone router decides exactly as with both off."""
    on_clock, off_clock = Clock(), Clock()
    on = _run_one_router(on_clock, make_policy(on_clock, load_peer_estimate=True))
    off = _run_one_router(off_clock, make_policy(off_clock, balance_fleet_scale=False, load_peer_estimate=False))
    assert on == off


def test_a_router_that_sees_a_quarter_of_the_outputs_reads_four_routers():
    clock = Clock()
    policy = make_policy(clock)
    for version, replica_id in enumerate(REPLICAS, 1):
        policy.on_summary(CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), 0, 10_000,
                                       mean_output_tokens=16.0))
    for number in range(32):
        clock.now += 0.1
        req = request(number)
        policy.on_routed(req, policy.rank(req)[0], str(number))
        policy.on_completed(str(number))
    for version, replica_id in enumerate(REPLICAS, 100):  # the fleet finished 4 x 32 requests of 16 tokens
        policy.on_summary(CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), 0, 10_000,
                                       num_output_tokens_total=4 * 32 * 16 // len(REPLICAS),
                                       mean_output_tokens=16.0))
    assert policy._routers_seen(clock.now) == pytest.approx(4.0, rel=0.05)  # noqa: SLF001


def test_other_routers_reported_work_drains_with_drain_foreign_load():
    """A replica that reported a queue other routers put there looks less
    loaded as time passes (at the fastest rate a replica was seen to work)."""
    clock = Clock()
    policy = make_policy(clock, drain_foreign_load=True)
    req = request(1)
    home = policy.rank(req)[0]
    other = policy.rank(req)[1]

    def send(version, queued, prefill_total):
        for replica_id in REPLICAS:
            policy.on_summary(CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), 0, 10_000,
                                           num_queued_tokens=queued if replica_id == home else 0,
                                           num_prefill_tokens_total=prefill_total))
    send(1, 0, 0)
    clock.now = 1.0
    send(2, 5_000, 1_000)  # every replica worked 1,000 tokens in 1 s; home holds 5,000 queued
    assert policy.rank(req)[0] == other  # home is 5,000 tokens behind
    clock.now = 6.5  # 5.5 s at 1,000 tokens/s: drained
    assert policy.rank(req)[0] == home
