"""router.PrefixAffinityPolicy with fake replicas and an injected clock."""

import logging

import pytest

from cache import RadixCache, block_hashes
from cache.summary import CacheSummary
from router import PolicyConfig, PrefixAffinityPolicy, RoutingRequest
from tests.router.fake_clock import Clock

BLOCK = 4
REPLICAS = [f"replica-{i}" for i in range(8)]


def make_policy(clock=None, replicas=REPLICAS, **config):
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, **config), clock=clock or Clock())
    policy.set_replicas(replicas)
    return policy


# Scenarios laid out in work units around the bound, the premium or copies keep the balance term as it was
# when they were written (balance_weight 0.2, a quarter of its measure busy time) and one affinity weight for
# every prefix (no hot_affinity_weight, session 49); the defaults since (0.6 and 0.6, 2026-12-06; 5.5 for a
# prefix drawing a tenth of a replica's work) are pinned by test_decision_pins.py and measured in BENCHMARKS.md.
EARLIER_BALANCE = {"balance_weight": 0.2, "balance_busy_share": 0.25, "hot_affinity_weight": None}


def request(tokens, salt=None, num_output_tokens=0):
    return RoutingRequest(tuple(block_hashes(tokens, BLOCK, salt)), len(tokens), salt, "", num_output_tokens)


def prompt(seed, num_tokens=32):
    return [seed * 1000 + i for i in range(num_tokens)]


def route(policy, req, request_id):
    """What the adapter does: take the first choice and report it."""
    chosen = policy.rank(req)[0]
    policy.on_routed(req, chosen, request_id)
    policy.check_invariants()
    return chosen


def summary(replica_id, version, tokens_list, load_tokens=0, budget_tokens=10_000):
    radix = RadixCache(budget_tokens, BLOCK)
    for tokens in tokens_list:
        radix.insert(tokens)
    return CacheSummary.from_radix(radix, BLOCK, replica_id=replica_id, version=version, timestamp_s=0.0,
                                   num_queued_tokens=load_tokens)


def test_cold_prefix_goes_to_its_ring_home():
    policy = make_policy()
    for seed in range(20):
        req = request(prompt(seed))
        assert policy.rank(req)[0] == policy.ring.lookup(req.block_hashes[0])


def test_routers_with_the_same_replicas_agree_on_cold_prefixes():
    a, b = make_policy(), make_policy(replicas=list(reversed(REPLICAS)))
    for seed in range(30):
        req = request(prompt(seed))
        assert a.rank(req) == b.rank(req)


def test_cold_prefixes_spread_over_the_fleet():
    policy = make_policy()
    homes = {policy.rank(request(prompt(seed)))[0] for seed in range(64)}
    assert len(homes) >= 6


def test_a_warm_prefix_follows_its_cache():
    clock = Clock()
    policy = make_policy(clock)
    shared = prompt(1, 64)
    first = route(policy, request(shared + [1, 2, 3, 4]), "q0")
    policy.on_completed("q0")
    for i in range(5):
        clock.now += 1.0
        assert route(policy, request(shared + [i, 9, 9, 9]), f"q{i + 1}") == first
        policy.on_completed(f"q{i + 1}")


def test_the_key_reaches_past_a_prefix_everyone_shares():
    """Once the shared system prompt is known, the ring key is the first block
    past it, so different questions get different homes."""
    policy = make_policy()
    system = prompt(7, 64)
    route(policy, request(system + prompt(99, 8)), "warmup")
    homes = set()
    for seed in range(40):
        req = request(system + prompt(seed, 16))
        homes.add(policy.ring.lookup(req.block_hashes[len(system) // BLOCK]))
    assert len(homes) >= 6


def test_a_shared_system_prompt_does_not_pin_everything_to_one_replica():
    clock = Clock()
    policy = make_policy(clock)
    system = prompt(7, 16)  # short next to the rest: near-cold
    chosen = []
    for seed in range(64):  # nothing completes: queues build up
        clock.now += 0.01
        chosen.append(route(policy, request(system + prompt(seed + 100, 48)), f"q{seed}"))
    counts = {r: chosen.count(r) for r in set(chosen)}
    assert len(counts) == len(REPLICAS) and max(counts.values()) <= 2 * 64 / len(REPLICAS)


def test_between_two_holders_the_less_loaded_wins():
    clock = Clock()
    policy = make_policy(clock)
    shared = prompt(3, 64)
    req = request(shared + [5, 5, 5, 5])
    policy.on_summary(summary("replica-1", 1, [shared]))
    policy.on_summary(summary("replica-2", 1, [shared]))
    policy.loads.on_routed("busy", "replica-1", 500.0, clock())
    assert policy.rank(req)[0] == "replica-2"


def _system_prompt_on_two_of_three(split, deficit):
    """Three replicas: ``replica-0`` and ``replica-1`` hold a 64-token system
    prompt (16 blocks), ``replica-2`` does not and did ``deficit`` tokens
    less recent work than they did (30,000 each, all completed: no queues);
    ``balance_weight`` 0.1. Returns the policy and a new conversation's
    first prompt (80 tokens)."""
    clock = Clock()
    policy = make_policy(clock, replicas=REPLICAS[:3], split_affinity_by_holders=split, balance_weight=0.1)
    system = prompt(9, 64)
    for replica_id in REPLICAS[:2]:
        policy.on_summary(summary(replica_id, 1, [system]))
    for i in range(30):
        for n, replica_id in enumerate(REPLICAS[:3]):
            policy.loads.on_routed(f"old{i}-{n}", replica_id, 1_000.0 - (deficit / 30 if n == 2 else 0), clock())
            policy.on_completed(f"old{i}-{n}")
    policy.check_invariants()
    return policy, request(system + prompt(10, 16))


def test_a_part_several_replicas_hold_weighs_what_it_saves_now():
    """The affinity premium of the system prompt is split between its two
    holders (w = 1 + 15 x 32/80 = 7 instead of 13 on 64 cached tokens), so the
    replica without it and 6,000 tokens behind takes the new conversation:
    its balance credit (0.1 x 6,000) beats 7 x 64 - 64 = 384 of premium but
    not 13 x 64 - 64 = 768. 10,000 behind, it wins either way; 3,000
    behind, neither way."""
    for split, deficit, expected in ((True, 6_000, {"replica-2"}), (False, 6_000, {"replica-0", "replica-1"}),
                                     (False, 10_000, {"replica-2"}), (True, 3_000, {"replica-0", "replica-1"})):
        policy, new_chat = _system_prompt_on_two_of_three(split, deficit)
        assert policy.rank(new_chat)[0] in expected, (split, deficit)


def test_a_part_one_replica_holds_keeps_its_whole_premium():
    """Nothing changes where every known block has one holder."""
    for split in (True, False):
        clock = Clock()
        policy = make_policy(clock, split_affinity_by_holders=split)
        history = prompt(11, 64)
        policy.on_summary(summary("replica-3", 1, [history]))
        for n, replica_id in enumerate(REPLICAS):
            policy.loads.on_routed(f"old{n}", replica_id, 9_000.0 if replica_id == "replica-3" else 8_000.0, clock())
            policy.on_completed(f"old{n}")
        assert policy.rank(request(history + prompt(12, 16)))[0] == "replica-3"


def test_holder_premium_divides_each_run_by_its_holders():
    from router.scoring import holder_premium
    premium = holder_premium([(6, 1), (4, 2), (2, 4)], block_size=10)  # blocks 0-1: 4 holders, 2-3: 2, 4-5: 1
    assert premium(0) == 0
    assert premium(20) == pytest.approx(20 / 4)
    assert premium(30) == pytest.approx(20 / 4 + 10 / 2)
    assert premium(60) == pytest.approx(20 / 4 + 20 / 2 + 20)
    assert premium(63) == pytest.approx(20 / 4 + 20 / 2 + 23)  # a within-block match: one holder
    assert holder_premium([(6, 1)], 10) is None and holder_premium([], 10) is None


def test_a_hot_prefix_spills_under_bounded_load_and_the_spill_target_gets_affinity():
    clock = Clock()
    policy = make_policy(clock, load_window_s=60.0)
    hot = prompt(5, 64)
    home = route(policy, request(hot + [0, 0, 0, 0]), "first")
    policy.on_completed("first")
    # The home has done far more than its share of the recent work (all of it
    # completed: its queue is empty, only the bound can refuse it).
    for i in range(30):
        policy.loads.on_routed(f"old{i}", home, 2_000.0, clock())
        policy.on_completed(f"old{i}")
    clock.now += 1.0
    spill = route(policy, request(hot + [1, 1, 1, 1]), "spill")
    assert spill != home
    policy.on_completed("spill")
    clock.now += 1.0
    # The spill target now holds the hot prefix: the next request sticks there.
    assert route(policy, request(hot + [2, 2, 2, 2]), "next") == spill


def _hot_home_with_a_mild_lead(load_slack_sd):
    """Two replicas; a hot prefix lives on its home, which did somewhat more
    than c × the mean lately: over the plain bound, within the chance slack
    (48 requests of 100 tokens: chance sd = sqrt(48e4 + 68^2) / 2 = 348); c = 1.25."""
    clock = Clock()
    policy = make_policy(clock, replicas=REPLICAS[:2], load_window_s=60.0, load_slack_sd=load_slack_sd,
                         load_factor=1.25, **EARLIER_BALANCE)
    hot = prompt(5, 64)
    home = route(policy, request(hot + [0, 0, 0, 0]), "first")  # 68 tokens of work
    policy.on_completed("first")
    other = next(r for r in REPLICAS[:2] if r != home)
    for i in range(48):  # home 3,400 + 68, other 1,400: mean 2,434, c x (mean + 2) + 68 = 3,113
        policy.loads.on_routed(f"old{i}", home if i < 34 else other, 100.0, clock())
        policy.on_completed(f"old{i}")
    return policy, hot, home, other


def test_a_holder_within_chance_of_the_bound_keeps_its_prefix():
    """The chance slack (2 sd x 64/68 cached = 655 tokens) covers the lead:
    the prefix stays; with no slack the same state replicates it."""
    policy, hot, home, other = _hot_home_with_a_mild_lead(2.0)
    assert policy.rank(request(hot + [1, 1, 1, 1]))[0] == home
    policy, hot, home, other = _hot_home_with_a_mild_lead(0.0)
    assert policy.rank(request(hot + [1, 1, 1, 1]))[0] == other


def test_a_cold_prompt_gets_no_chance_slack():
    """Same state: a cold prompt whose ring home is that replica, and which
    its empty queue would win, goes to the other (placing it there costs
    nothing, so the plain bound applies)."""
    policy, hot, home, other = _hot_home_with_a_mild_lead(2.0)
    policy.loads.on_routed("busy", other, 10.0, policy._clock())  # other's queue is longer
    cold = next(request(prompt(seed)) for seed in range(100, 200)
                if policy.ring.lookup(request(prompt(seed)).block_hashes[0]) == home)
    assert policy.rank(cold)[0] == other
    assert policy.rank(request(hot + [2, 2, 2, 2]))[0] == home


def _decode_heavy_and_prefill_heavy(price, queue_decode_token_cost):
    """Two replicas with the same recent work at the busy price (40 per
    output token): ``decoder`` did 100 outputs on 32-token prompts,
    ``prefiller`` 4,032-token prompts with no output; all completed. Returns
    the policy, them, and a cold prompt whose ring home is ``prefiller``."""
    clock = Clock()
    policy = make_policy(clock, replicas=REPLICAS[:2], decode_token_cost=40.0, balance_output_price=price,
                         queue_decode_token_cost=queue_decode_token_cost)
    return (policy, *book_decode_heavy_and_prefill_heavy(policy))


def book_decode_heavy_and_prefill_heavy(policy):
    """On the policy's first two replicas, ``decoder`` gets 100 outputs on
    32-token prompts, ``prefiller`` 4,032-token prompts with no output (the
    same recent work at 40 per output token); all complete. Returns them and
    a cold prompt whose ring home is ``prefiller``."""
    decoder, prefiller = REPLICAS[:2]
    for i in range(4):
        for replica_id, num_prompt, num_output in ((decoder, 32, 100), (prefiller, 4032, 0)):
            tokens = prompt(500 + 2 * i + (replica_id == prefiller), num_prompt)
            policy.on_routed(request(tokens, num_output_tokens=num_output), replica_id, f"{replica_id}{i}")
            policy.on_completed(f"{replica_id}{i}")
    policy.check_invariants()
    cold = next(request(prompt(seed)) for seed in range(100, 200)
                if policy.ring.lookup(request(prompt(seed)).block_hashes[0]) == prefiller)
    return decoder, prefiller, cold


def test_the_balance_term_prices_an_output_token_at_its_queue_price():
    """Under batching (queue price 4 < busy price 40) a decode-heavy
    replica's recent work weighs less in the balance term, so a cold prompt
    goes there rather than to the replica that computed long prompts (whose
    cache turned over); at the busy price both look alike and the ring
    decides."""
    policy, decoder, prefiller, cold = _decode_heavy_and_prefill_heavy("queue", 4.0)
    assert policy.loads.recent_work(decoder, 0.0) == pytest.approx(policy.loads.recent_work(prefiller, 0.0))
    assert policy.rank(cold)[0] == decoder
    policy, decoder, prefiller, cold = _decode_heavy_and_prefill_heavy("busy", 4.0)
    assert policy.rank(cold)[0] == prefiller


def test_with_one_price_the_balance_term_reads_recent_work():
    """FIFO (queue price = busy price): "queue" and "busy" are the same rule."""
    for price in ("queue", "busy"):
        policy, decoder, prefiller, cold = _decode_heavy_and_prefill_heavy(price, None)
        assert policy.rank(cold)[0] == prefiller
        assert not policy._queue_priced.is_active


def test_the_balance_term_weighs_the_busy_time_this_router_saw():
    """Replica 0 served two requests at once for half a second, replica 1 one
    request for 8 s: replica 0 did twice the work, replica 1 was busy 16x as
    long (under batching, overlapping requests share their steps). On recent
    work alone a cold prompt goes to replica 1, even from a ring home on
    replica 0; with half the balance measure on the busy time this router
    saw (its requests' spans, routed to completed), to replica 0, even from
    a ring home on replica 1."""
    for share, expected in ((0.0, REPLICAS[1]), (0.5, REPLICAS[0])):
        clock = Clock()
        policy = make_policy(clock, replicas=REPLICAS[:2], balance_busy_share=share)
        for i, replica in enumerate((REPLICAS[0], REPLICAS[0], REPLICAS[1])):
            policy.on_routed(request(prompt(100 + i)), replica, f"q{i}")
        clock.now = 0.5
        policy.on_completed("q0")
        policy.on_completed("q1")
        clock.now = 8.0
        policy.on_completed("q2")
        policy.check_invariants()
        assert policy.loads.recent_work(REPLICAS[0], 8.0) == pytest.approx(2 * policy.loads.recent_work(REPLICAS[1], 8.0))
        homed_elsewhere = next(request(prompt(seed)) for seed in range(200, 300)
                               if policy.ring.lookup(request(prompt(seed)).block_hashes[0]) != expected)
        assert policy.rank(homed_elsewhere)[0] == expected


def test_a_burst_decided_before_any_is_reported_sees_its_own_decisions():
    """Ray reports a request routed only after the replica accepted it: with
    request ids, decisions reserve at once, so a burst of cold prefixes splits
    evenly and a burst of one prefix stays together."""
    policy = make_policy(replicas=REPLICAS[:2])
    chosen = [policy.rank(request(prompt(seed)), request_id=f"cold{seed}")[0] for seed in range(8)]
    assert sorted(chosen.count(r) for r in REPLICAS[:2]) == [4, 4]
    shared = prompt(50, 64)
    together = {policy.rank(request(shared + [i, i, i, i]), request_id=f"warm{i}")[0] for i in range(5)}
    assert len(together) == 1
    assert policy.loads.num_reserved() == 13
    policy.check_invariants()


def test_on_routed_confirms_a_reservation_or_moves_it():
    policy = make_policy(replicas=REPLICAS[:2])
    req = request(prompt(1, 64), num_output_tokens=2)  # 64 uncached + 2 x 40 decode = 144 tokens of work
    chosen = policy.rank(req, request_id="q")[0]
    assert policy.rank(req, request_id="q")[0] == chosen  # asked again: still counted as cold
    assert policy.loads.load(chosen) == 144.0
    policy.on_routed(req, chosen, "q")  # confirmed: not counted twice
    assert policy.loads.load(chosen) == 144.0 and policy.loads.num_reserved() == 0
    other = next(r for r in REPLICAS[:2] if r != chosen)
    req2 = request(prompt(2, 64))
    first = policy.rank(req2, request_id="q2")[0]
    elsewhere = chosen if first == other else other
    policy.on_routed(req2, elsewhere, "q2")  # the first choice was full: moved
    policy.check_invariants()
    assert policy.loads.load(first) == (144.0 if first == chosen else 0.0)
    assert policy.loads.load(elsewhere) == 64.0 + (144.0 if elsewhere == chosen else 0.0)
    policy.on_completed("q2")
    assert policy.loads.load(elsewhere) == (144.0 if elsewhere == chosen else 0.0)


def test_a_reservation_never_confirmed_is_forgotten():
    clock = Clock()
    policy = make_policy(clock, replicas=REPLICAS[:2], reservation_timeout_s=5.0)
    chosen = policy.rank(request(prompt(3)), request_id="cancelled")[0]
    assert policy.loads.load(chosen) == 32.0
    clock.now = 6.0
    after = route(policy, request(prompt(4)), "next")
    assert policy.loads.num_reserved() == 0 and policy.loads.num_in_flight() == 1
    # Neither its queued nor its recent work is left: only "next" counts.
    assert policy.loads.load(chosen) == (32.0 if after == chosen else 0.0)
    assert policy.loads.recent_work(chosen, clock.now) == pytest.approx(32.0 if after == chosen else 0.0, abs=1e-9)


def test_when_every_candidate_is_over_the_bound_the_ring_walk_finds_one():
    clock = Clock()
    policy = make_policy(clock, num_ring_candidates=1, load_window_s=60.0)
    req = request(prompt(11))
    walk = list(policy.ring.walk(req.block_hashes[0]))
    for i, replica in enumerate(walk[:4]):  # home and the next three did everything lately
        policy.loads.on_routed(f"x{i}", replica, 100_000.0, clock())
        policy.on_completed(f"x{i}")
    for i, replica in enumerate(walk[4:]):  # the rest are busy now, so the least loaded is over too
        policy.loads.on_routed(f"y{i}", replica, 10.0, clock())
    ranked = policy.rank(req)
    assert ranked[0] == walk[4]  # the first node past the home that is under the bound


def test_stale_summaries_are_corrected_by_fresh_ones():
    clock = Clock()
    policy = make_policy(clock, learned_grace_s=5.0)
    shared = prompt(4, 64)
    req = request(shared + [8, 8, 8, 8])
    policy.on_summary(summary("replica-3", 5, [shared]))
    assert policy.rank(req)[0] == "replica-3"
    clock.now = 10.0
    assert not policy.on_summary(summary("replica-3", 4, []))  # older version: ignored
    assert policy.rank(req)[0] == "replica-3"
    assert policy.on_summary(summary("replica-3", 6, []))  # evicted since
    policy.check_invariants()
    assert policy.rank(req)[0] == policy.ring.lookup(req.block_hashes[0])


def test_a_summary_keeps_what_the_router_routed_after_it_was_taken():
    clock = Clock()
    policy = make_policy(clock, learned_grace_s=5.0)
    shared = prompt(6, 64)
    first = route(policy, request(shared), "q")
    clock.now = 1.0
    policy.on_summary(summary(first, 1, []))  # taken before the request ran
    assert policy.rank(request(shared + [1, 1, 1, 1]))[0] == first


def test_a_removed_replica_is_never_chosen():
    clock = Clock()
    policy = make_policy(clock)
    shared = prompt(2, 64)
    holder = route(policy, request(shared), "q")
    policy.remove_replica(holder)
    policy.check_invariants()
    for seed in range(50):
        assert holder not in policy.rank(request(shared + prompt(seed, 8)))
        assert holder not in policy.rank(request(prompt(seed + 500)))
    assert not policy.on_summary(summary(holder, 9, [shared]))  # late report of the dead


def test_a_replica_vanishing_mid_decision_is_skipped():
    policy = make_policy()
    req = request(prompt(12))
    home = policy.rank(req)[0]
    live = set(REPLICAS) - {home}
    ranked = policy.rank(req, live)
    assert ranked and home not in ranked and set(ranked) <= live
    policy.on_routed(req, "replica-unknown", "q")  # it left while we decided: ignored
    policy.check_invariants()


def test_request_without_tokens_is_routed():
    policy = make_policy()
    ranked = policy.rank(RoutingRequest((), 0))
    assert ranked and set(ranked) <= set(REPLICAS)


def test_request_without_routing_attributes_falls_back_to_least_loaded_with_a_log_line(caplog):
    clock = Clock()
    policy = make_policy(clock)
    for i, replica in enumerate(REPLICAS[1:]):
        policy.loads.on_routed(f"q{i}", replica, 100.0, clock())
    with caplog.at_level(logging.WARNING, logger="router.policy"):
        ranked = policy.rank(object())
    assert ranked[0] == "replica-0"
    assert "least loaded fallback" in caplog.text
    with caplog.at_level(logging.WARNING, logger="router.policy"):
        assert policy.rank(None)[0] == "replica-0"
        assert policy.rank(RoutingRequest, REPLICAS[:2])[0] == "replica-0"


def test_fallback_ties_rotate_instead_of_piling_on_one_replica():
    clock = Clock()
    policy = make_policy(clock)
    chosen = set()
    for i in range(8):
        clock.now += 0.1
        replica = policy.rank(object())[0]
        policy.on_routed(object(), replica, f"q{i}")
        policy.on_completed(f"q{i}")
        chosen.add(replica)
    assert len(chosen) == 8


def test_candidates_the_router_does_not_know_fall_back_with_a_log_line(caplog):
    policy = make_policy()
    with caplog.at_level(logging.WARNING, logger="router.policy"):
        assert policy.rank(request(prompt(1)), ["new-replica"]) == ["new-replica"]
    assert "fallback" in caplog.text


def test_empty_candidates_give_no_answer_and_a_log_line(caplog):
    policy = make_policy()
    with caplog.at_level(logging.WARNING, logger="router.policy"):
        assert policy.rank(request(prompt(1)), []) == []
    assert "no candidate" in caplog.text
    assert make_policy(replicas=[]).rank(request(prompt(1))) == []


@pytest.mark.parametrize("stats", [None, {}])
def test_missing_stats_are_ignored(stats):
    policy = make_policy()
    assert policy.on_routing_stats("replica-0", stats) is False


@pytest.mark.parametrize("stats", [{"format": "nope"}, ["list"], {"format": "kvroute.cache_summary.v1"}])
def test_malformed_stats_are_ignored_with_a_log_line(stats, caplog):
    policy = make_policy()
    with caplog.at_level(logging.WARNING, logger="router.policy"):
        assert policy.on_routing_stats("replica-0", stats) is False
    assert "malformed routing stats" in caplog.text
    policy.check_invariants()


def test_routing_stats_feed_the_index_and_the_load():
    policy = make_policy()
    shared = prompt(8, 64)
    wire = summary("someone-else", 1, [shared], load_tokens=700).to_dict()
    assert policy.on_routing_stats("replica-5", wire)  # Ray says whose stats these are
    assert policy.rank(request(shared + [1, 2, 3, 4]))[0] == "replica-5"
    assert policy.loads.load("replica-5") == 700


def test_stats_already_seen_are_skipped_before_parsing(caplog):
    policy = make_policy()
    wire = summary("replica-5", 3, [prompt(8, 64)]).to_dict()
    assert policy.on_routing_stats("replica-5", wire)
    stale = {**wire, "block_hashes": "not even base64"}  # same version: never decoded
    with caplog.at_level(logging.WARNING, logger="router.policy"):
        assert not policy.on_routing_stats("replica-5", stale)
    assert caplog.text == ""


def test_a_summary_at_another_block_size_is_ignored(caplog):
    policy = make_policy()
    radix = RadixCache(1000, 8)
    radix.insert(prompt(1))
    other = CacheSummary.from_radix(radix, 8, replica_id="replica-0", version=1, timestamp_s=0.0)
    with caplog.at_level(logging.WARNING, logger="router.policy"):
        assert not policy.on_summary(other)
    assert "block size" in caplog.text


def test_set_replicas_joins_and_leaves_at_once():
    policy = make_policy(replicas=REPLICAS[:4])
    policy.set_replicas(REPLICAS[2:6])
    policy.check_invariants()
    assert policy.replica_ids == frozenset(REPLICAS[2:6])


def test_tenants_do_not_share_affinity():
    clock = Clock()
    policy = make_policy(clock)
    shared = prompt(9, 64)
    holder = route(policy, request(shared, salt="tenant-a"), "q")
    other = request(shared + [1, 1, 1, 1], salt="tenant-b")
    assert policy.index.deepest_holders(other.block_hashes, 4)[1] == {}
    assert holder == policy.rank(request(shared + [1, 1, 1, 1], salt="tenant-a"))[0]


@pytest.mark.parametrize("field, value", [
    ("block_size", 0), ("load_factor", 0.5), ("affinity_weight", 0.0), ("load_window_s", 0),
    ("num_ring_candidates", 0), ("decode_token_cost", -1.0), ("balance_output_price", "free"), ("balance_busy_share", 1.5), ("balance_busy_share", -0.1), ("num_ranked", 1.5), ("load_factor", True),
    ("load_slack_sd", -1.0), ("reservation_timeout_s", 0), ("premium_pending_min_users", 0),
    ("premium_needs_completion", 1), ("hot_affinity_weight", 0.5), ("hot_affinity_weight", float("inf")),
    ("hot_affinity_weight", True), ("hot_affinity_share", -0.1), ("cold_queue_weight", -1.0),
    ("batching_turnover_credit", 1),
])
def test_bad_config_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})


def test_the_policy_needs_a_clock():
    with pytest.raises(ValueError, match="clock"):
        PrefixAffinityPolicy(PolicyConfig())


def test_fallback_requests_weigh_like_typical_requests():
    """After real traffic, a request of unknown size counts as a typical one,
    so a stream of them spreads instead of filling the idlest replica."""
    clock = Clock()
    policy = make_policy(clock)
    for i in range(64):
        clock.now += 0.1
        route(policy, request(prompt(i, 256)), f"real{i}")
        policy.on_completed(f"real{i}")
    chosen = []
    for i in range(16):
        clock.now += 0.1
        replica = policy.rank(None)[0]
        policy.on_routed(None, replica, f"bad{i}")
        policy.on_completed(f"bad{i}")
        chosen.append(replica)
    assert max(chosen.count(r) for r in set(chosen)) <= 4
