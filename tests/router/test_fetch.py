"""Fetch hints (issue 13): PrefixAffinityPolicy.decide and router.fetch."""

import random

import pytest

from cache import block_hashes
from router import PolicyConfig, PrefixAffinityPolicy, RoutingRequest
from router.fetch import FetchHint, RoutingDecision, fetch_credit, fetchable_tokens, hint_for

BLOCK = 4
REPLICAS = [f"replica-{i}" for i in range(4)]
SHARED = [7000 + i for i in range(32)]  # 8 blocks every request of a hot group shares


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


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
    policy = make_policy(clock)
    decisions = route_hot_group(policy, clock)
    owner = decisions[0][1].ranked[0]
    assert decisions[0][1].fetch is None  # cold: nobody to fetch from
    spilled = [d for _, d in decisions if d.ranked[0] != owner]
    assert spilled, "the hot group never left its home"
    first_spill = spilled[0]
    assert first_spill.fetch == FetchHint(owner, len(SHARED))
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


@pytest.mark.parametrize("fetch_token_cost", [0.1, 0.5, 1.0])
def test_a_hinted_reservation_counts_the_fetched_tokens_at_the_fetch_cost(fetch_token_cost):
    clock = Clock()
    policy = make_policy(clock, fetch_token_cost=fetch_token_cost)
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
    counted = cached + (1 - fetch_token_cost) * (fetched - cached)
    queue_decode = policy.config.queue_token_cost * req.num_output_tokens  # below the prior: max_tokens
    assert policy.loads.load(target) - load_before[target] == pytest.approx(len(SHARED) + 6 - counted + queue_decode)


def test_every_hint_keeps_the_decision_invariants():
    clock = Clock()
    policy = make_policy(clock, fetch_min_tokens=2 * BLOCK)
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
            assert hint.num_tokens - held[first] > 2 * BLOCK
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
    for bad in ({"fetch_min_tokens": -1}, {"fetch_token_cost": 1.5}, {"fetch_enabled": 1}):
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


@pytest.mark.parametrize("share, leaves", [(0.0, False), (1.0, True)])
def test_fetch_affinity_share_weighs_fetchable_tokens_like_cached_ones(share, leaves):
    """An owner with 500 tokens queued, within its bound: with the fetchable
    tokens weighed as cached (share 1) an idle replica that can fetch them is
    cheaper; at share 0 they count only at their fetch cost and the owner
    keeps the request."""
    clock = Clock()
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, fetch_min_tokens=BLOCK, fetch_affinity_share=share),
                                  clock=clock)
    policy.set_replicas(["owner", "idle"])
    prefix = SHARED + [8000 + i for i in range(32)]  # 64 tokens, 16 blocks
    policy.on_summary(summary_of("owner", 1, [prefix], 500))
    policy.on_summary(summary_of("idle", 1, [], 0))
    decision = policy.decide(request(prefix + [1, 2, 3, 4]))
    assert decision.ranked[0] == ("idle" if leaves else "owner")
    assert decision.fetch == (FetchHint("owner", 64) if leaves else None)
