"""Fetch hints (issue 13): PrefixAffinityPolicy.decide and router.fetch."""

import random

import pytest

from cache import block_hashes
from router import PolicyConfig, PrefixAffinityPolicy, RoutingRequest
from router.fetch import (FetchHint, FetchPlan, RoutingDecision, fetch_credit, fetchable_tokens, hint_for,
                          within_block_hint)
from tests.router.fake_clock import Clock

BLOCK = 4
REPLICAS = [f"replica-{i}" for i in range(4)]
SHARED = [7000 + i for i in range(32)]  # 8 blocks every request of a hot group shares


# The rule before replicate_hot_prefixes and backup_fetch_hints (both on by default since 2026-12-04) and
# hot_affinity_weight (session 49; like replication it weighs a prefix differently where a fetch pays): the
# tests of the "never" scope's identity and of the owner-over-bound hint use it; the newer rules' are in
# tests/router/test_replication.py.
BEFORE_REPLICATION = {"replicate_hot_prefixes": False, "backup_fetch_hints": False, "hot_affinity_weight": None,
                      "queue_copy_requests": 0}


def make_policy(clock=None, **config):
    config = {"fetch_min_tokens": BLOCK, **config}
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, **config), clock=clock or Clock())
    policy.set_replicas(REPLICAS)
    return policy


def request(tokens, salt=None):
    return RoutingRequest(tuple(block_hashes(tokens, BLOCK, salt)), len(tokens), salt, "", 8)


def hot_request(i, salt=None):
    return request(SHARED + [90_000 + 10 * i + j for j in range(6)], salt)


def route_hot_group(policy, clock, num_requests=60, salt=None):
    """Route a hot group's requests one by one (none completes, so its home
    fills up); returns every (request, decision)."""
    decisions = []
    for i in range(num_requests):
        clock.now += 0.01
        req = hot_request(i, salt)
        decision = policy.decide(req, request_id=f"{salt}-{i}")
        policy.on_routed(req, decision.ranked[0], f"{salt}-{i}")
        policy.check_invariants()
        decisions.append((req, decision))
    return decisions


def test_a_hint_names_the_owner_when_the_owner_is_over_its_bound():
    clock = Clock()
    policy = make_policy(clock, **BEFORE_REPLICATION)
    decisions = route_hot_group(policy, clock)
    owner = decisions[0][1].ranked[0]
    assert decisions[0][1].fetch is None  # cold: nobody to fetch from
    spilled = [d for _, d in decisions if d.ranked[0] != owner]
    assert spilled, "the hot group never left its home"
    first_spill = spilled[0]
    # none of the hot group's requests has completed: the first is still computing the prefix at its home
    assert first_spill.fetch == FetchHint(owner, len(SHARED), owner_computing=True)
    for _, decision in decisions:
        if decision.ranked[0] == owner:
            assert decision.fetch is None


def test_no_hint_when_fetch_is_disabled():
    clock = Clock()
    policy = make_policy(clock, fetch_enabled=False)
    decisions = route_hot_group(policy, clock)
    owner = decisions[0][1].ranked[0]
    assert any(d.ranked[0] != owner for _, d in decisions)  # it spills all the same
    assert all(d.fetch is None for _, d in decisions)


def test_no_hint_when_the_first_choice_is_the_owner():
    clock = Clock()
    policy = make_policy(clock)
    first = policy.decide(hot_request(0), request_id="a")
    policy.on_routed(hot_request(0), first.ranked[0], "a")
    policy.on_completed("a")
    clock.now += 1.0
    again = policy.decide(hot_request(1))
    assert again.ranked[0] == first.ranked[0]
    assert again.fetch is None


def test_no_hint_when_the_owner_holds_no_more_than_fetch_min_tokens_beyond_the_first_choice():
    clock = Clock()
    policy = make_policy(clock, fetch_min_tokens=len(SHARED))  # the whole shared prefix is "too little"
    decisions = route_hot_group(policy, clock)
    owner = decisions[0][1].ranked[0]
    assert any(d.ranked[0] != owner for _, d in decisions)
    assert all(d.fetch is None for _, d in decisions)


def test_rank_is_decide_ranked():
    clocks = Clock(), Clock()
    by_rank, by_decide = make_policy(clocks[0]), make_policy(clocks[1])
    rng = random.Random(3)
    for i in range(200):
        for clock in clocks:
            clock.now += 0.01
        tokens = SHARED[: 4 * rng.randint(0, 8)] + [rng.randrange(10**6) for _ in range(rng.randint(1, 12))]
        req = request(tokens)
        ranked = by_rank.rank(req, request_id=str(i))
        decision = by_decide.decide(req, request_id=str(i))
        assert ranked == list(decision.ranked)
        assert type(ranked) is list
        done = str(rng.randrange(i + 1)) if rng.random() < 0.5 else None
        for policy in (by_rank, by_decide):
            policy.on_routed(req, ranked[0], str(i))
            if done is not None:
                policy.on_completed(done)


def test_a_holder_under_another_salt_is_never_hinted():
    clock = Clock()
    policy = make_policy(clock)
    decisions = route_hot_group(policy, clock, salt="tenant-a")
    owner = decisions[0][1].ranked[0]
    assert any(d.fetch is not None and d.fetch.owner == owner for _, d in decisions)  # tenant a would fetch
    for i in range(60):  # the same tokens for tenant b: its hashes differ, nobody holds them
        clock.now += 0.01
        req = hot_request(1000 + i, salt="tenant-b")
        decision = policy.decide(req, request_id=f"b-{i}")
        policy.on_routed(req, decision.ranked[0], f"b-{i}")
        if decision.fetch is not None:  # only tenant b's own earlier requests can own its blocks
            assert policy.index.depth(decision.fetch.owner, req.block_hashes) * BLOCK >= decision.fetch.num_tokens
            assert i > 0


def test_a_hint_only_ever_names_a_holder_of_the_same_tenant_blocks():
    clock = Clock()
    policy = make_policy(clock)
    route_hot_group(policy, clock, salt="tenant-a")
    fresh = hot_request(5000, salt="tenant-b")
    assert policy.decide(fresh).fetch is None  # tenant a's copy of the very same tokens does not count


@pytest.mark.parametrize("scope, fetch_token_cost", [("always", 0.1), ("always", 0.5), ("always", 1.0),
                                                     ("never", 0.1)])
def test_a_hinted_reservation_counts_the_fetched_tokens_at_the_fetch_cost_where_the_credit_chose(
        scope, fetch_token_cost):
    """Where the fetch credit was open ("always") the booking counts the
    fetched tokens at their cost; under "never" the decision is the no-fetch
    one and so is its booking ("over_bound": test_fetch_plan_opens_...)."""
    clock = Clock()
    policy = make_policy(clock, fetch_token_cost=fetch_token_cost, fetch_credit_scope=scope)
    for i in range(200):
        clock.now += 0.01
        req = hot_request(i)
        load_before = {r: policy.loads.load(r) for r in REPLICAS}
        cached_before = {r: policy.index.depth(r, req.block_hashes) * BLOCK for r in REPLICAS}
        decision = policy.decide(req, request_id=str(i))
        if decision.fetch is not None:
            break
        policy.on_routed(req, decision.ranked[0], str(i))
    else:
        pytest.fail("no hint in 200 requests of a hot group")
    target, fetched = decision.ranked[0], decision.fetch.num_tokens
    cached = cached_before[target]
    counted = cached + (1 - fetch_token_cost) * (fetched - cached) if scope != "never" else cached
    queue_decode = policy.config.queue_token_cost * req.num_output_tokens  # below the prior: max_tokens
    assert policy.loads.load(target) - load_before[target] == pytest.approx(len(SHARED) + 6 - counted + queue_decode)


@pytest.mark.parametrize("knobs", [{}, BEFORE_REPLICATION])
def test_every_hint_keeps_the_decision_invariants(knobs):
    clock = Clock()
    policy = make_policy(clock, fetch_min_tokens=2 * BLOCK, **knobs)
    rng = random.Random(11)
    prefixes = [[rng.randrange(10**6) for _ in range(4 * rng.randint(1, 10))] for _ in range(6)]
    num_hints = 0
    for i in range(600):
        clock.now += rng.uniform(0.0, 0.05)
        tokens = rng.choice(prefixes) + [rng.randrange(10**6) for _ in range(rng.randint(0, 9))]
        req = request(tokens)
        held = {r: policy.index.depth(r, req.block_hashes) * BLOCK for r in REPLICAS}  # before it is reserved
        decision = policy.decide(req, request_id=str(i))
        first = decision.ranked[0]
        if decision.fetch is not None:
            num_hints += 1
            hint = decision.fetch
            assert hint.owner != first and hint.owner in REPLICAS
            assert hint.num_tokens % BLOCK == 0 and 0 < hint.num_tokens < len(tokens)
            assert held[hint.owner] >= hint.num_tokens
            is_backup = held[first] >= hint.num_tokens  # the first choice holds it too (backup_fetch_hints)
            assert hint.num_tokens - held[first] > 2 * BLOCK or (is_backup and policy.config.backup_fetch_hints)
        policy.on_routed(req, first, str(i))
        if rng.random() < 0.6:
            policy.on_completed(str(rng.randrange(i + 1)))
        policy.check_invariants()
    assert num_hints > 0


def test_decide_never_raises():
    policy = make_policy()
    assert policy.decide(object()) == RoutingDecision(tuple(policy.rank(object())), None)
    assert policy.decide(hot_request(0), candidate_ids=[]) == RoutingDecision((), None)


# ------------------------------------------------------------------ the pure parts
def test_fetchable_tokens_is_the_deepest_holder_in_whole_blocks_below_the_prompt():
    loads = {"a": 5.0, "b": 1.0, "c": 0.0}.get
    assert fetchable_tokens({"a": 3, "b": 3, "c": 1}, 4, 40, loads) == ("b", 12)  # least loaded of the deepest
    assert fetchable_tokens({"a": 10}, 4, 40, loads) == ("a", 36)  # the last prompt token is computed
    assert fetchable_tokens({"a": 1}, 4, 4, loads) is None
    assert fetchable_tokens({}, 4, 40, loads) is None


def test_hint_for_needs_more_than_min_tokens_beyond_the_first_choice():
    assert hint_for("b", 4, ("a", 12), 8) is None  # 8 more: not more than 8
    assert hint_for("b", 0, ("a", 12), 8) == FetchHint("a", 12)
    assert hint_for("a", 0, ("a", 12), 0) is None  # the owner itself
    assert hint_for("b", 0, None, 0) is None


def test_within_block_hint_names_the_partial_block_holder_where_it_knows_more():
    plain = FetchHint("a", 128, ("c",))
    assert within_block_hint(None, 128, "w", 176, 16) == FetchHint("w", 176)  # 48 more than the first choice
    assert within_block_hint(None, 128, "w", 144, 16) is None  # 16 more: not more than min_tokens
    assert within_block_hint(plain, 0, "w", 176, 16) == FetchHint("w", 176)  # more than the plain hint
    assert within_block_hint(plain, 0, "w", 128, 16) is plain  # no more than it: the plain hint, alternates kept
    assert within_block_hint(plain, 0, None, 0, 16) is plain  # no within-block holder (or it is the first choice)


def test_fetch_credit():
    assert fetch_credit(("a", 100), "b", 20, 50, 0.25) == pytest.approx(60.0)
    assert fetch_credit(("a", 100), "b", 60, 50, 0.25) == 0.0
    assert fetch_credit(("a", 100), "a", 0, 0, 0.25) == 0.0


def test_records_reject_bad_values():
    with pytest.raises(ValueError):
        FetchHint("", 4)
    with pytest.raises(ValueError):
        FetchHint("a", 0)
    with pytest.raises(ValueError):
        RoutingDecision(("a", "b"), FetchHint("a", 4))
    with pytest.raises(ValueError):
        RoutingDecision((), FetchHint("a", 4))
    assert RoutingDecision(["a"]).ranked == ("a",)
    for alternates in (("a",), ("b", "b"), ("",), (3,), "bc"):  # the owner, twice, empty, not an id, not a tuple
        with pytest.raises(ValueError):
            FetchHint("a", 4, alternates)
    with pytest.raises(ValueError):
        RoutingDecision(("c", "a"), FetchHint("a", 4, ("c",)))  # the first choice among those a hint names
    for flag in (1, "yes", None):
        with pytest.raises(ValueError):
            FetchHint("a", 4, owner_computing=flag)
    assert not FetchHint("a", 4).owner_computing and FetchHint("a", 4, owner_computing=True).owner_computing
    hint = FetchHint("a", 4, ["b", "c"])
    assert hint.alternates == ("b", "c") and hint.owners == ("a", "b", "c") and FetchHint("a", 4).owners == ("a",)
    assert RoutingDecision(("d",), hint).fetch is hint
    for bad in ({"fetch_min_tokens": -1}, {"fetch_token_cost": 1.5}, {"fetch_enabled": 1},
                {"fetch_credit_scope": "sometimes"}, {"fetch_credit_scope": None}, {"fetch_alternates": -1},
                {"fetch_alternates": 1.0}, {"queue_copy_requests": -1}, {"queue_copy_gap_requests": float("nan")},
                {"queue_copy_room_factor": -0.5}):
        with pytest.raises(ValueError):
            PolicyConfig(**bad)


def summary_of(replica_id, version, tokens_list, queued_tokens):
    from cache import RadixCache
    from cache.summary import CacheSummary
    radix = RadixCache(10_000, BLOCK)
    for tokens in tokens_list:
        radix.insert(tokens)
    return CacheSummary.from_radix(radix, BLOCK, replica_id=replica_id, version=version, timestamp_s=0.0,
                                   num_queued_tokens=queued_tokens)


@pytest.mark.parametrize("scope, share, leaves", [("always", 0.0, False), ("always", 1.0, True),
                                                  ("over_bound", 1.0, False), ("never", 1.0, False)])
def test_fetch_affinity_share_weighs_fetchable_tokens_like_cached_ones(scope, share, leaves):
    """An owner with 500 tokens queued, within its bound: with the fetchable
    tokens weighed as cached (share 1, credit against any owner) an idle
    replica that can fetch them is cheaper; at share 0 they count only at
    their fetch cost and the owner keeps the request. An owner within its
    bound opens no credit under "over_bound", nor does any under "never"."""
    clock = Clock()
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, fetch_min_tokens=BLOCK, fetch_affinity_share=share,
                                               fetch_credit_scope=scope), clock=clock)
    policy.set_replicas(["owner", "idle"])
    prefix = SHARED + [8000 + i for i in range(32)]  # 64 tokens, 16 blocks
    policy.on_summary(summary_of("owner", 1, [prefix], 500))
    policy.on_summary(summary_of("idle", 1, [], 0))
    decision = policy.decide(request(prefix + [1, 2, 3, 4]))
    assert decision.ranked[0] == ("idle" if leaves else "owner")
    assert decision.fetch == (FetchHint("owner", 64) if leaves else None)


def route_mixed(policy, clock, seed):
    """Hot groups and cold prompts with completions, the same for every
    policy given the same seed; yields each (request, decision)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10**6) for _ in range(4 * rng.randint(2, 10))] for _ in range(5)]
    for i in range(500):
        clock.now += rng.uniform(0.0, 0.04)
        tokens = (rng.choice(prefixes) if rng.random() < 0.8 else []) + [rng.randrange(10**6) for _ in range(9)]
        req = request(tokens)
        decision = policy.decide(req, request_id=str(i))
        policy.on_routed(req, decision.ranked[0], str(i))
        if rng.random() < 0.5:
            policy.on_completed(str(rng.randrange(i + 1)))
        yield req, decision


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_under_scope_never_fetch_only_adds_hints_to_the_no_fetch_decisions(seed):
    """The default rule: with the same inputs, the policy with fetch on
    ranks and books exactly as with fetch off; a hint goes exactly where the
    first choice is not the owner and lacks more than fetch_min_tokens of
    it (the no-fetch rule spilled or queued the request away from its home)."""
    clocks = Clock(), Clock()
    with_fetch = make_policy(clocks[0], **BEFORE_REPLICATION)
    without = make_policy(clocks[1], fetch_enabled=False, **BEFORE_REPLICATION)
    assert with_fetch.config.fetch_credit_scope == "never" == PolicyConfig().fetch_credit_scope
    num_hints = 0
    for (req, decision), (_, plain) in zip(route_mixed(with_fetch, clocks[0], seed),
                                           route_mixed(without, clocks[1], seed)):
        assert decision.ranked == plain.ranked and plain.fetch is None
        for replica_id in REPLICAS:
            assert with_fetch.loads.load(replica_id) == without.loads.load(replica_id)
        if decision.fetch is not None:
            num_hints += 1
            assert decision.fetch.owner != decision.ranked[0]
            assert with_fetch.index.depth(decision.fetch.owner, req.block_hashes) * BLOCK >= decision.fetch.num_tokens
    assert num_hints > 0, "the workload never spilled a holder's prefix"


@pytest.mark.parametrize("scope, owner_over, credited", [
    ("never", False, False), ("never", True, False), ("over_bound", False, False), ("over_bound", True, True),
    ("always", False, True), ("always", True, True)])
def test_fetch_plan_opens_the_credit_by_scope(scope, owner_over, credited):
    """The credit (and the discounted booking) only where the scope allows:
    under over_bound, only while the owner is over its bound."""
    asked = []

    def is_over(replica_id, num_tokens):
        asked.append((replica_id, num_tokens))
        return owner_over

    plan = FetchPlan({"owner": 4, "light": 0}, lambda r: 0, BLOCK, 40, lambda r: 0.0, 0, 0.1, scope, is_over)
    assert plan.credit("light", 0) == (pytest.approx(0.9 * 16) if credited else 0.0)
    assert plan.credit("owner", 16) == 0.0  # the owner fetches nothing
    hint = plan.hint("light", 0)
    assert hint == FetchHint("owner", 16)  # hinted whatever the scope
    assert plan.booked_tokens(hint) == (16 if credited else 0)
    assert plan.booked_tokens(None) == 0
    assert asked == ([("owner", 16)] if scope == "over_bound" else [])  # asked once per decision
    with pytest.raises(ValueError):
        FetchPlan({}, lambda r: 0, BLOCK, 40, lambda r: 0.0, 0, 0.1, "over_bound", None)
