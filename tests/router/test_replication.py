"""Hot prefixes gain fetched holders (replicate_hot_prefixes), backup fetch
hints (backup_fetch_hints), and the demand they are measured by
(router.prefix_demand)."""

import dataclasses
import math
import random

import pytest

from cache import block_hashes
from cache.summary import CacheSummary
from router.fetch import FetchHint, FetchPlan
from router.fetch_cost import ReportedFetchCost
from router.prefix_demand import PrefixDemand
from router.request import RoutingRequest
from router.sim_fetch import SimFetch, plan_fetch
from router.policy_config import PolicyConfig
from router.simulate import SimConfig, simulate
from router.workload import multi_turn, shared_prefix
from tests.router.fake_clock import Clock
from tests.router.test_fetch import BLOCK, REPLICAS, SHARED, hot_request, request, route_hot_group
from tests.router.test_fetch import make_policy as make_fetch_policy
from tests.router.test_policy import summary
from tests.router.test_sim_fetch import FAST, make_replica, warm_owner
from tests.router.test_sim_fetch import request as sim_request

OFF = {"replicate_hot_prefixes": False, "backup_fetch_hints": False, "hot_affinity_weight": None,
       "queue_copy_requests": 0}  # the rule before


def make_policy(clock=None, **config):
    """The fetch tests' policy with the balance term on recent work alone, at
    the weight it had when they were written (0.2): these scenarios are laid
    out in work units, and the share of observed busy time
    (``balance_busy_share``; tests/router/test_busy_spans.py and
    test_policy.py) or the stronger default weight would move their cold
    requests."""
    return make_fetch_policy(clock, **{"balance_busy_share": 0.0, "balance_weight": 0.2, **config})


# ------------------------------------------------------------------ PrefixDemand
def test_demand_decays_over_the_window_and_adds_up():
    demand = PrefixDemand(window_s=10.0)
    demand.add(7, 100.0, now=0.0)
    assert demand.value(7, 0.0) == 100.0
    assert demand.value(7, 10.0) == pytest.approx(100.0 / math.e)
    demand.add(7, 50.0, now=10.0)
    assert demand.value(7, 10.0) == pytest.approx(100.0 / math.e + 50.0)
    assert demand.value(8, 10.0) == 0.0  # never booked
    demand.add(8, -5.0, now=10.0)  # no negative demand
    assert demand.value(8, 10.0) == 0.0
    demand.check_invariants()
    demand.clear()
    assert len(demand) == 0 and demand.value(7, 10.0) == 0.0


def test_demand_forgets_the_least_recently_booked_prefix_beyond_its_bound():
    demand = PrefixDemand(window_s=10.0, max_keys=2)
    demand.add(1, 1.0, now=0.0)
    demand.add(2, 1.0, now=1.0)
    demand.add(1, 1.0, now=2.0)  # 1 is the most recent now
    demand.add(3, 1.0, now=3.0)  # 2 goes
    assert len(demand) == 2 and demand.value(2, 3.0) == 0.0 and demand.value(1, 3.0) > 0.0
    demand.check_invariants()


@pytest.mark.parametrize("bad", [{"window_s": 0.0}, {"window_s": 1.0, "max_keys": 0},
                                 {"window_s": 1.0, "max_keys": 1.5}])
def test_demand_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        PrefixDemand(**bad)


def test_demand_matches_a_naive_sum_of_decayed_bookings():
    rng = random.Random(3)
    demand, bookings, now = PrefixDemand(window_s=5.0, max_keys=1000), [], 0.0
    for _ in range(2000):
        now += rng.uniform(0.0, 0.3)
        key, work = rng.randrange(20), rng.uniform(0.0, 100.0)
        demand.add(key, work, now)
        bookings.append((key, work, now))
        probe = rng.randrange(25)
        naive = sum(w * math.exp((t - now) / 5.0) for k, w, t in bookings if k == probe)
        assert demand.value(probe, now) == pytest.approx(naive, rel=1e-9, abs=1e-9)
    demand.check_invariants()


# ------------------------------------------------------------------ ReportedFetchCost
def test_the_fetch_cost_is_the_prior_until_measured_then_the_pooled_medians():
    cost = ReportedFetchCost(prior_token_cost=0.1, history=2)
    assert cost.cost(1000) == pytest.approx(0.1)
    cost.report("a", 0.0, 0.0)  # not measured
    assert cost.cost(1000) == pytest.approx(0.1)
    cost.report("a", 0.2, 100.0)
    assert cost.cost(1000) == pytest.approx(0.2 + 0.1) and cost.cost(100) == pytest.approx(1.2)
    cost.report("b", 0.4, 300.0)
    assert (cost.token_cost, cost.overhead_tokens) == (pytest.approx(0.3), pytest.approx(200.0))
    for value in (0.6, 0.6):  # "a" keeps its last 2 reports: [0.6, 0.6]
        cost.report("a", value, 0.0)
    assert cost.token_cost == pytest.approx(0.6) and cost.overhead_tokens == pytest.approx(0.0)
    cost.check_invariants({"a", "b"})
    cost.remove("a")
    assert cost.token_cost == pytest.approx(0.4)
    cost.remove("b")  # nobody left: the last measured cost stays
    assert cost.token_cost == pytest.approx(0.4)
    with pytest.raises(ValueError):
        ReportedFetchCost(-1.0)
    with pytest.raises(ValueError):
        ReportedFetchCost(0.1, history=0)


# ------------------------------------------------------------------ the policy
def serve_a_quarter_hot(policy, clock, num_requests=120):
    """Every fourth request shares one prefix, the rest are cold; six in
    flight, so no replica goes over the load bound. The replicas the hot
    requests went to, in order; each hint checked against the index."""
    rng, in_flight, hot = random.Random(1), [], []
    for i in range(num_requests):
        clock.now += 0.05
        req = hot_request(i) if i % 4 == 0 else request([rng.randrange(10**6) for _ in range(38)])
        held = {r: policy.index.depth(r, req.block_hashes) * BLOCK for r in REPLICAS}
        decision = policy.decide(req, request_id=str(i))
        policy.on_routed(req, decision.ranked[0], str(i))
        in_flight.append(str(i))
        if len(in_flight) > 6:
            policy.on_completed(in_flight.pop(0))
        if i % 4 == 0:
            hot.append(decision.ranked[0])
            if decision.fetch is not None:
                assert held[decision.fetch.owner] >= decision.fetch.num_tokens == len(SHARED)
        policy.check_invariants()
    return hot


def test_a_hot_prefix_gains_fetched_holders_while_its_holders_are_within_the_bound():
    """A quarter of the traffic shares one prefix: without replication it
    keeps to the two replicas that came to hold it (the premium keeps it
    there; nobody is over the bound). Its demand per holder is far above a
    quarter of a replica's mean work, so with replication a lighter replica
    is credited the fetchable prefix as if cached: the group spreads over
    all four, each newcomer hinted to fetch it from a holder (the premium
    on pending blocks, which splits bursts in flight too, is off here)."""
    served = {}
    for name, knobs in (("on", {}), ("off", OFF)):
        clock = Clock()
        served[name] = serve_a_quarter_hot(make_policy(clock, premium_needs_completion=False, **knobs), clock)[:20]
    assert len(set(served["off"])) == 2
    assert len(set(served["on"])) == 4


@pytest.mark.parametrize("room", [0.0, 1.4, 1.6])
def test_a_new_holder_needs_room_for_one_and_a_half_copies(room):
    """``replica_room_factor`` = 1.5: every replica reports room for
    ``room`` x the fetchable prefix (and nothing of it). Below 1.5 copies
    (0: a full cache, where a copy would evict, maybe the only copy of
    something else) no credit opens and the hot prefix goes exactly where
    the rule without replication sends it (two holders); above, lighter
    replicas are credited and the group spreads over all four. (The
    turnover term, which full caches switch on, is off: this isolates the
    room rule.)"""
    assert PolicyConfig().replica_room_factor == 1.5
    served = {}
    for name, knobs in (("on", {}), ("off", OFF)):
        clock = Clock()
        policy = make_policy(clock, premium_needs_completion=False, turnover_weight=0.0, **knobs)
        for version, replica_id in enumerate(REPLICAS, 1):
            unrelated = [[10**6 * version + i for i in range(1000)]]
            budget = 1000 + round(room * len(SHARED))
            assert policy.on_summary(summary(replica_id, version, unrelated, budget_tokens=budget))
        served[name] = serve_a_quarter_hot(policy, clock)[:20]
    assert len(set(served["off"])) == 2
    if room < 1.5:
        assert served["on"] == served["off"]
    else:
        assert len(set(served["on"])) == 4


def test_a_prefix_reused_now_and_then_is_not_replicated():
    """Forty prefixes, each reused once in a while: none draws a quarter of a
    replica's work, so every decision is the one the rule without
    replication makes."""
    chosen = {}
    for name, knobs in (("on", {"hot_affinity_weight": None}), ("off", OFF)):
        clock = Clock()
        policy = make_policy(clock, **{**knobs, "backup_fetch_hints": False})
        rng = random.Random(5)
        prefixes = [[100_000 * p + i for i in range(16)] for p in range(40)]
        out = []
        for i in range(400):
            clock.now += 0.05
            req = request(rng.choice(prefixes) + [rng.randrange(10**6) for _ in range(5)])
            decision = policy.decide(req, request_id=str(i))
            policy.on_routed(req, decision.ranked[0], str(i))
            if i >= 8:
                policy.on_completed(str(i - 8))
            out.append((decision.ranked, decision.fetch))
        policy.check_invariants()
        chosen[name] = out
    assert chosen["on"] == chosen["off"]


def test_a_first_choice_among_two_holders_gets_a_backup_hint_naming_the_other():
    for backup in (True, False):
        clock = Clock()
        policy = make_policy(clock, replicate_hot_prefixes=False, backup_fetch_hints=backup)
        for i, replica_id in enumerate(REPLICAS[:2]):  # two replicas hold the prefix
            policy.on_routed(hot_request(i), replica_id, f"seed{i}")
            policy.on_completed(f"seed{i}")
        clock.now += 1.0
        decision = policy.decide(hot_request(9), request_id="next")
        first = decision.ranked[0]
        assert first in REPLICAS[:2]
        other = next(r for r in REPLICAS[:2] if r != first)
        assert decision.fetch == (FetchHint(other, len(SHARED)) if backup else None)
        policy.check_invariants()


def test_a_backup_hint_needs_a_second_holder_of_a_prefix_worth_fetching():
    loads = {"a": 1.0, "b": 0.0, "c": 0.0}.get
    plan = FetchPlan({"a": 4, "b": 4, "c": 2}, lambda r: 0, BLOCK, 40, loads, 4, 0.1, "never")
    assert plan.backup_hint("a") == FetchHint("b", 16)
    assert plan.backup_hint("b") == FetchHint("a", 16)
    assert plan.backup_hint("c") is None  # not among the deepest: the ordinary hint rule applies
    assert plan.hint("c", 8, backup=True) == FetchHint("b", 16)  # the least loaded of the deepest
    assert FetchPlan({"a": 4}, lambda r: 0, BLOCK, 40, loads, 4, 0.1, "never").backup_hint("a") is None
    assert FetchPlan({"a": 1, "b": 1}, lambda r: 0, BLOCK, 40, loads, 4, 0.1, "never").backup_hint("a") is None
    # the deepest alone: the deepest of the others backs it up, for what it holds (more than min_tokens)
    shallower = FetchPlan({"a": 6, "b": 3, "c": 3, "d": 1}, lambda r: 0, BLOCK, 40, loads, 4, 0.1, "never")
    assert shallower.backup_hint("a") == FetchHint("b", 12)
    assert FetchPlan({"a": 6, "d": 1}, lambda r: 0, BLOCK, 40, loads, 4, 0.1, "never").backup_hint("a") is None


def test_a_first_choice_outside_the_candidates_is_backed_up_too():
    """The candidates list names at most ``max_affinity_candidates`` of the
    deepest holders; a first choice that holds the prefix too but joined as
    a ring node (not listed) is still backed up by a listed holder.
    Shared-prefix FIFO at 8,000 tokens, credit "always" with
    ``affinity_weight`` 4, workload seed 3: with four other holders listed,
    such a first choice got no hint, had evicted its fetched copy since its
    last report, and recomputed 1,024 tokens two other replicas held."""
    loads = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 2.0}.get
    depth_of = {"d": 4}.get
    plan = FetchPlan({"a": 4, "b": 4, "c": 4}, lambda r: depth_of(r, 0), BLOCK, 40, loads, 4, 0.1, "never")
    assert plan.backup_hint("d") == FetchHint("b", 16)  # the least loaded of the listed holders
    assert plan.hint("d", 0, backup=True) == FetchHint("b", 16)
    assert plan.hint("d", 0, backup=False) is None
    # an unlisted first choice the index knows nothing of gets the ordinary hint, not a backup
    assert plan.backup_hint("e") is None
    assert plan.hint("e", 0, backup=True) == FetchHint("b", 16)


def test_a_chat_moved_from_its_old_home_is_backed_up_by_it():
    """Multi-turn FIFO, workload seed 5: a turn fetched to a new home, which
    then evicted the fetched copy (a copy goes first) within the router's
    grace for what it routed. The next turn went there by the index and,
    without a backup hint naming the old home (which held all but the last
    turn), recomputed 1,024 tokens another replica held. (The scene is of
    the rule before ``fifo_work_left`` and ``queue_copy_any_prefix``, whose
    early decisions, while caches have room, place the chats otherwise.)"""
    figures = {}
    for backup in (True, False):
        config = SimConfig(num_replicas=8, budget_tokens=16000, seed=5, policy=PolicyConfig(
            backup_fetch_hints=backup, hot_affinity_weight=None, fifo_work_left=False, queue_copy_any_prefix=False))
        figures[backup] = simulate(multi_turn(seed=5), config, ["ours"], progress=False,
                                   seeds=range(5, 6))["policies"]["ours"]
    assert figures[False]["held_elsewhere_rate"] > 0.001
    assert figures[True]["held_elsewhere_rate"] == 0.0
    assert figures[True]["hit_rate"] > figures[False]["hit_rate"] + 0.001


def test_the_replica_credit_is_the_fetch_credit_where_there_is_room():
    plan = FetchPlan({"owner": 4, "light": 0, "full": 0}, lambda r: 0, BLOCK, 40, lambda r: 0.0, 0, 0.1, "never")
    credit = plan.replica_credit(lambda replica_id, num_tokens: replica_id != "full" and num_tokens == 16)
    assert credit("light", 0) == pytest.approx(0.9 * 16)
    assert credit("full", 0) == 0.0
    assert credit("owner", 16) == 0.0  # the owner fetches nothing
    assert not plan.credit_open and plan.booked_tokens(plan.hint("light", 0)) == 0  # booked as without fetch


# ------------------------------------------------------------------ the simulator
@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_a_receiver_holding_the_hinted_prefix_ignores_a_backup_hint(model):
    owner = warm_owner(model)
    receiver = warm_owner(model)  # holds it too
    plan = plan_fetch(SimFetch(owner, 400, FAST), tuple(range(410)), 1, 400, lambda n: min(n, 409),
                      receiver.cost if model == "fifo" else receiver.profile, 1.0)
    assert (plan.reason, plan.num_units, plan.num_tokens) == ("held", 0, 0)
    receiver.submit(1, sim_request(10.0, tuple(range(400)) + (9, 9)), 10.0, SimFetch(owner, 400, FAST))
    receiver.advance(math.inf)
    counts = receiver.fetch_counts
    assert (counts.num_held, counts.num_fetched, counts.num_evicted) == (1, 0, 0)
    assert receiver.outcomes[1].cached_tokens == 400 and receiver.outcomes[1].fetched_tokens == 0
    assert make_replica(model, "fresh").fetch_counts.num_held == 0


def test_shared_prefix_fifo_spreads_its_hot_groups_at_the_same_hit_rate():
    """Workload seed 3, where the rule without replication homes three of the
    16 groups on one replica (imbalance 1.225, BENCHMARKS.md): with it, the
    hot groups gain fetched holders, every system prompt is still computed
    once, and the imbalance and the TTFT tail fall."""
    figures = {}
    for name, knobs in (("on", {}), ("off", OFF)):
        config = SimConfig(num_replicas=8, budget_tokens=8000, seed=3, policy=PolicyConfig(**knobs))
        result = simulate(shared_prefix(seed=3), config, ["ours"], progress=False, seeds=range(3, 4))
        figures[name] = result["policies"]["ours"]
    on, off = figures["on"], figures["off"]
    assert on["hit_rate"] == off["hit_rate"] == pytest.approx(15 / 16 * 1024 / 1088)
    assert on["num_fetches"] > off["num_fetches"]
    assert on["load_imbalance"] < off["load_imbalance"] - 0.1
    assert on["ttft_p99_s"] < 0.6 * off["ttft_p99_s"]


@pytest.mark.parametrize("fetch_token_cost, spreads", [(0.1, True), (0.7, False), (1.5, False)])
def test_a_hot_prefix_gains_holders_only_where_the_replicas_report_that_a_fetch_pays(fetch_token_cost, spreads):
    """Every replica reports (empty caches, room for anything) what a fetch
    costs it: at 0.1 prefill tokens per fetched token the hot prefix
    spreads; at 1.5 a new holder would recompute rather than fetch, and at
    0.7 the margin (``max_replica_fetch_cost`` 0.5) is not there, so the
    policy decides exactly as without replication."""
    served = {}
    for name, knobs in (("on", {}), ("off", OFF)):
        clock = Clock()
        policy = make_policy(clock, premium_needs_completion=False, **knobs)
        for version, replica_id in enumerate(REPLICAS, 1):
            assert policy.on_summary(CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), budget_tokens=10_000,
                                                  fetch_token_cost=fetch_token_cost, fetch_overhead_tokens=4.0))
        served[name] = serve_a_quarter_hot(policy, clock)[:20]
    if spreads:
        assert len(set(served["on"])) == 4 > len(set(served["off"]))
    else:
        assert served["on"] == served["off"]


# ------------------------------------------------------------------ queued copies, alternates
def route_behind_a_queue(room_tokens=None, prompts=None, running=None, peer_output_tokens=None, peer_decision=False,
                         **knobs):
    """200 cold requests set the typical request's work (each completes);
    then 8 requests of one prefix arrive and none completes. Short outputs,
    so the prefix's premium outweighs a queue at its home. With
    ``room_tokens``, every replica reports that much free cache first;
    with ``running`` = (running, waiting), every replica reports so many
    requests running and waiting; with ``peer_output_tokens``, every
    replica then reports that many output tokens more than at its first
    report (other routers' requests: ``RouterShare``); with
    ``peer_decision``, another router's decision is booked first.
    ``prompts``: the 8 requests' tokens
    (default: ``SHARED`` and 6 tokens of their own, so prompts branch at
    its last block). Each hot request's (first choice, hint)."""
    clock = Clock()
    knobs = {"replicate_hot_prefixes": False, "premium_needs_completion": False, **knobs}
    policy = make_policy(clock, **knobs)
    if room_tokens is not None or running is not None:  # each holds 1,000 tokens of something else
        for version, replica_id in enumerate(REPLICAS, 1):
            unrelated = [[10**6 * version + i for i in range(1000)]]
            report = summary(replica_id, version, unrelated, budget_tokens=1000 + (room_tokens or 10**5))
            if running is not None:
                report = dataclasses.replace(report, num_running=running[0], num_waiting=running[1])
            assert policy.on_summary(report)
    rng = random.Random(0)
    for i in range(200):
        clock.now += 0.05
        cold = short_request([rng.randrange(10**6) for _ in range(38)])
        policy.on_routed(cold, policy.decide(cold, request_id=f"c{i}").ranked[0], f"c{i}")
        policy.on_completed(f"c{i}")
    if peer_output_tokens is not None:
        for version, replica_id in enumerate(REPLICAS, 100):
            for step, total in enumerate((0, peer_output_tokens)):
                report = dataclasses.replace(summary(replica_id, version + 10 * step, []), mean_output_tokens=1.0,
                                             num_output_tokens_total=total)
                assert policy.on_summary(report)
    if peer_decision:  # another router's decision, shared (router.serve_decisions)
        policy.on_peer_routed(short_request([5 * 10**6 + i for i in range(38)]), REPLICAS[0])
    decisions = []
    if prompts is None:
        prompts = [SHARED + [90_000 + 10 * i + j for j in range(6)] for i in range(8)]
    for i, tokens in enumerate(prompts):
        clock.now += 0.01
        hot = short_request(tokens)
        held = {r: policy.index.depth(r, hot.block_hashes) for r in REPLICAS}
        decision = policy.decide(hot, request_id=str(i))
        policy.on_routed(hot, decision.ranked[0], str(i))
        if decision.fetch is not None:  # every replica a hint names holds what it hints
            assert all(held[r] * BLOCK >= decision.fetch.num_tokens for r in decision.fetch.owners)
        decisions.append((decision.ranked[0], decision.fetch))
        policy.check_invariants()
    return decisions


def short_request(tokens):
    return RoutingRequest(tuple(block_hashes(tokens, BLOCK)), len(tokens), None, "", 1)


def test_a_prefix_queued_at_its_one_holder_gains_a_fetched_holder():
    """``queue_copy_requests`` = 2: once the prefix's holder has more than
    two typical requests' work queued, a replica with at least one typical
    request less queued and room for two copies takes the next request and
    is hinted to fetch the prefix. With two holders there are no more
    copies (session 52: the copies that cost hit where caches are full).
    Off (0), every request queues at the home."""
    config = PolicyConfig()
    assert (config.queue_copy_requests, config.queue_copy_gap_requests, config.queue_copy_room_factor) == (1, 1, 2)
    off = route_behind_a_queue(queue_copy_requests=0)
    assert {first for first, _ in off} == {off[0][0]} and all(hint is None for _, hint in off)
    home = off[0][0]
    on = route_behind_a_queue(queue_copy_requests=2)
    assert [first for first, _ in on[:3]] == [home] * 3 and all(hint is None for _, hint in on[:3])
    copy, hint = on[3]
    assert copy != home and hint == FetchHint(home, len(SHARED))
    assert {first for first, _ in on} == {home, copy}  # a second holder, no third


def test_a_queued_copy_is_of_a_prefix_prompts_branch_at_not_of_a_chats_history():
    """Each request continuing the one before it (a chat's turns: its
    known prefix ends where the last prompt ended) gets no queued copy;
    copying it would move the chat and leave its history behind. The same
    prompts with a turn of their own after a shared part do (above)."""
    chat = list(SHARED)
    turns = []
    for i in range(8):
        chat = chat + [90_000 + 10 * i + j for j in range(8)]  # two blocks more per turn
        turns.append(list(chat))
    routed = route_behind_a_queue(prompts=turns, queue_copy_requests=2)
    assert len({first for first, _ in routed}) == 1 and all(hint is None for _, hint in routed)


def test_a_queued_copy_waits_until_the_holder_has_computed_the_prefix():
    """With the holder's first request still prefilling it (none here
    completes; tracked with ``premium_needs_completion``), a copy's fetch
    would wait for that prefill: the rule makes no copy, and every decision
    is the one without it."""
    on = route_behind_a_queue(queue_copy_requests=2, premium_needs_completion=True)
    off = route_behind_a_queue(queue_copy_requests=0, premium_needs_completion=True)
    assert on == off


@pytest.mark.parametrize("peers, copied", [({"peer_output_tokens": 0}, True), ({"peer_decision": True}, False)])
def test_no_queued_copy_while_other_routers_share_the_traffic(peers, copied):
    """Another router's decision was shared with this one (or, read the same
    way, the replicas' output counters grow past this router's own
    completions: ``RouterShare``): the others' requests at the holder are
    unseen here, so whether it holds the only copy and has computed it is a
    guess, and the rule decides nothing. Simulated, 4 routers, shared-prefix
    FIFO, seeds 0-15: hit 0.8729 with copies, 0.8784 without."""
    on = route_behind_a_queue(queue_copy_requests=2, **peers)
    off = route_behind_a_queue(queue_copy_requests=0, **peers)
    assert (on != off) == copied


@pytest.mark.parametrize("running, copied", [((1, 0), True), ((2, 0), False), ((2, 1), True)])
def test_a_queued_copy_needs_a_holder_that_queues_what_it_has_in_flight(running, copied):
    """A holder that reported two requests running at once batches: what
    it has in flight runs together, and a copy would move a request from
    no queue. Unless its report had requests waiting; a holder that never
    ran two at once queues them all (:class:`ReplicaQueueing`)."""
    routed = route_behind_a_queue(running=running, queue_copy_requests=2)
    assert (len({first for first, _ in routed}) > 1) == copied


@pytest.mark.parametrize("copies, copied", [(1.9, False), (2.1, True)])
def test_a_queued_copy_needs_room_for_two_copies(copies, copied):
    on = route_behind_a_queue(room_tokens=round(copies * len(SHARED)), queue_copy_requests=2)
    assert (len({first for first, _ in on}) > 1) == copied


@pytest.mark.parametrize("running, floored", [((1, 1), True), ((2, 1), False)])
def test_a_fifo_holder_s_queue_must_be_worth_the_copy_s_footprint(running, floored):
    """``queue_copy_size_factor`` (2): a holder not seen batching (here it
    reported one running and requests waiting) must also have queued that
    many times the copy's tokens (here the 32-token prefix): a
    copy stays cached at both replicas while both serve the prefix. The
    larger the factor, the longer the home's queue before the first copy;
    with none that long, no copy at all. A holder seen running two at once,
    reporting requests waiting (its batch or KV cache full), has no floor
    (simulated, the floor cost heavy Mooncake batching 0.0010 of hit)."""
    assert PolicyConfig().queue_copy_size_factor == 2
    first_copy = {}
    for factor in (2, 6, 8, 12):
        firsts = [first for first, _ in route_behind_a_queue(running=running, queue_copy_requests=2,
                                                             queue_copy_size_factor=factor)]
        first_copy[factor] = next((i for i, replica_id in enumerate(firsts) if replica_id != firsts[0]), None)
    assert first_copy == ({2: 3, 6: 4, 8: 5, 12: None} if floored else {2: 3, 6: 3, 8: 3, 12: 3})


def test_a_first_choice_short_of_a_block_of_the_prefix_gets_a_backup_hint():
    """A radix cache evicts a prefix from its deepest block up: a first
    choice whose last report lacked only the last block (at most
    ``fetch_min_tokens``) may have evicted it all since, so it is hinted to
    the deepest holder; without backup hints it gets none (the gap is not
    worth a fetch of its own)."""
    loads = {"a": 0.0, "b": 1.0, "c": 0.5}.get
    plan = FetchPlan({"a": 3, "b": 4, "c": 4}, lambda r: 0, BLOCK, 40, loads, 4, 0.1, "never", max_alternates=2)
    assert plan.hint("a", 12, backup=True) == FetchHint("c", 16, ("b",))
    assert plan.hint("a", 12, backup=False) is None
    assert plan.backup_hint("a") == FetchHint("c", 16)  # the alternates come with hint()
    assert FetchPlan({"a": 2, "b": 4}, lambda r: 0, BLOCK, 40, loads, 4, 0.1, "never").backup_hint("a") is None


def test_a_hint_names_the_other_holders_as_deep_least_loaded_first():
    loads = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 0.0, "e": 0.5, "x": 9.0}.get
    depths = {"a": 4, "b": 4, "c": 4, "d": 2, "e": 5}
    plan = FetchPlan(depths, lambda r: 0, BLOCK, 20, loads, 4, 0.1, "never", max_alternates=2)
    # the prompt caps the fetchable prefix at 4 blocks (16 of its 20 tokens): e, the least loaded of the
    # deepest, owns it; b and c, as deep as the hint, follow by load; d is too shallow; a is third
    assert plan.hint("x", 0) == FetchHint("e", 16, ("b", "c"))
    assert plan.hint("b", 16, backup=True) == FetchHint("e", 16, ("c", "a"))  # never the first choice
    unnamed = FetchPlan(depths, lambda r: 0, BLOCK, 20, loads, 4, 0.1, "never")
    assert unnamed.hint("x", 0) == FetchHint("e", 16)


def test_a_hint_names_holders_that_have_computed_the_prefix_before_those_still_computing_it():
    """A receiver asking a holder whose copy is still being prefilled waits
    for it, or recomputes once that outlasts its patience, while another
    holder could export at once: owners and alternates are named computed
    first, then least loaded (``FetchPlan(computing=...)``)."""
    loads = {"a": 0.0, "b": 1.0, "c": 2.0, "x": 9.0}.get
    depths = {"a": 4, "b": 4, "c": 4}
    still_computing = {"a"}.__contains__
    plan = FetchPlan(depths, lambda r: 0, BLOCK, 20, loads, 4, 0.1, "never", max_alternates=2,
                     computing=still_computing)
    assert plan.hint("x", 0) == FetchHint("b", 16, ("c", "a"))
    assert plan.backup_hint("b") == FetchHint("c", 16)
    by_load = FetchPlan(depths, lambda r: 0, BLOCK, 20, loads, 4, 0.1, "never", max_alternates=2)
    assert by_load.hint("x", 0) == FetchHint("a", 16, ("b", "c"))


def test_an_alternate_holder_keeps_a_prefix_the_hinted_owner_evicted():
    """Shared-prefix FIFO, workload seed 0, the defaults (queued copies
    on): a request's hinted owner had evicted its group's prefix since its
    last report. Named alone (``fetch_alternates`` 0) it costs a recompute
    of the whole system prompt; named with the other holders, the receiver
    fetches it from one of them. (Found first at seed 21, then 33, under
    earlier rules.)"""
    figures = {}
    for alternates in (0, 2):
        config = SimConfig(num_replicas=8, budget_tokens=8000, seed=0, policy=PolicyConfig(fetch_alternates=alternates))
        figures[alternates] = simulate(shared_prefix(seed=0), config, ["ours"], progress=False,
                                       seeds=range(0, 1))["policies"]["ours"]
    one_prompt = 1024 / (256 * 1088)  # of the prompt tokens: 16 groups x 16 prompts of 1,088 tokens
    assert figures[0]["num_fetch_evicted"] == 1 and figures[0]["num_fetch_from_alternate"] == 0
    assert figures[2]["num_fetch_from_alternate"] == 1 and figures[2]["num_fetch_evicted"] == 0
    assert figures[2]["hit_rate"] == pytest.approx(figures[0]["hit_rate"] + one_prompt)
