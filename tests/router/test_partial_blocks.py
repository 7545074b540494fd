"""Within-block affinity: router.partial_blocks and its use in the policy."""

import pytest

from cache import RadixCache, block_hashes
from cache.hashing import continue_block_hashes
from cache.summary import CacheSummary
from router import PolicyConfig, PrefixAffinityPolicy, RoutingRequest
from router.fetch import FetchHint
from router.partial_blocks import PartialBlockIndex, sub_block_keys
from tests.router.fake_clock import Clock

BLOCK, SUB = 16, 4


def tokens(seed, n):
    return [seed * 1000 + i for i in range(n)]


# ------------------------------------------------------------------ the index
def test_keys_name_growing_starts_of_a_block_under_its_parent():
    keys = sub_block_keys(7, tokens(1, 12), SUB, max_keys=3)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert sub_block_keys(7, tokens(1, 9), SUB, max_keys=3) == keys[:2]  # 9 tokens: two whole sub-blocks
    assert sub_block_keys(8, tokens(1, 12), SUB, max_keys=3)[0] != keys[0]  # another parent chain
    assert sub_block_keys(7, tokens(1, 15), SUB, max_keys=3) == keys  # at most max_keys
    # key j is the chained hash of the block's first j * SUB tokens taken as one block
    assert keys[1] == continue_block_hashes(7, tokens(1, 8), 8)[0]


def test_match_finds_the_longest_shared_start_and_its_replica():
    index = PartialBlockIndex(BLOCK, SUB)
    index.learn("a", 7, tokens(1, 10))  # keys for 4 and 8 tokens
    assert index.match(7, tokens(1, 16)) == ("a", 8)
    assert index.match(7, tokens(1, 6)) == ("a", 4)
    assert index.match(7, tokens(1, 3)) is None  # under one sub-block
    assert index.match(7, tokens(2, 16)) is None  # other tokens
    assert index.match(9, tokens(1, 16)) is None  # same tokens after another prefix
    index.learn("b", 7, tokens(1, 4))
    assert index.match(7, tokens(1, 16)) == ("a", 8)  # deeper wins
    assert index.match(7, tokens(1, 5)) == ("b", 4)  # the most recent router of a key wins
    index.check_invariants()


def test_entries_stay_within_the_bound_least_recent_out_first():
    index = PartialBlockIndex(BLOCK, SUB, max_entries=4)
    index.learn("a", 1, tokens(1, 8))
    index.learn("b", 2, tokens(2, 8))
    assert index.match(1, tokens(1, 8)) == ("a", 8)  # touches key (1, 8 tokens)
    index.learn("c", 3, tokens(3, 4))
    assert len(index) == 4
    assert index.match(1, tokens(1, 6)) is None  # (1, 4 tokens) was the least recent
    assert index.match(1, tokens(1, 8)) == ("a", 8)
    assert index.match(2, tokens(2, 8)) == ("b", 8)
    index.check_invariants()


def test_tokens_that_are_not_ids_give_no_match_and_no_error():
    index = PartialBlockIndex(BLOCK, SUB)
    index.learn("a", 1, ("x",) * 8)
    index.learn("a", 1, (1 << 70,) * 8)
    assert index.match(1, ("x",) * 8) is None
    assert len(index) == 0


@pytest.mark.parametrize("block, sub", [(16, 0), (16, 16), (16, 5), (0, 4)])
def test_bad_sizes_raise_value_error(block, sub):
    with pytest.raises(ValueError, match="must"):
        PartialBlockIndex(block, sub)


@pytest.mark.parametrize("sub", [-4, 5, 16, 2.0])
def test_policy_config_checks_the_grain(sub):
    with pytest.raises(ValueError, match="sub_block_tokens"):
        PolicyConfig(block_size=BLOCK, sub_block_tokens=sub)


def test_the_grain_defaults_to_a_quarter_block_at_most_16_tokens():
    assert PolicyConfig(block_size=64).within_block_tokens == 16
    assert PolicyConfig(block_size=32).within_block_tokens == 8
    assert PolicyConfig(block_size=512).within_block_tokens == 16  # a Mooncake replay's block
    assert PolicyConfig(block_size=100).within_block_tokens == 25  # 16 does not divide it
    assert PolicyConfig(block_size=6).within_block_tokens == 0
    assert PolicyConfig(block_size=64, sub_block_tokens=8).within_block_tokens == 8


# ------------------------------------------------------------------ the policy
SYSTEM = tokens(9, 2 * BLOCK)  # two full blocks every chat shares


def make_policy(clock=None, **config):
    """Two replicas holding SYSTEM. One affinity weight for every prefix
    (``hot_affinity_weight`` off): SYSTEM draws all the work here, and the
    lighter weight would let the balance term outweigh a turn's 8-token
    partial block, which these scenarios weigh against it."""
    config = {"block_size": BLOCK, "sub_block_tokens": SUB, "hot_affinity_weight": None} | config
    policy = PrefixAffinityPolicy(PolicyConfig(**config),
                                  clock=clock or Clock())
    policy.set_replicas(["x", "y"])
    for version, replica in enumerate(["x", "y"]):  # both hold the system prompt
        radix = RadixCache(10_000, BLOCK)
        radix.insert(SYSTEM)
        policy.on_summary(CacheSummary.from_radix(radix, BLOCK, replica_id=replica, version=version,
                                                  timestamp_s=0.0))
    return policy


def chat_request(prompt, salt=None):
    return RoutingRequest(tuple(block_hashes(prompt, BLOCK, salt)), len(prompt), salt, "", 4, tuple(prompt))


def serve(policy, request, request_id):
    chosen = policy.rank(request, request_id=request_id)[0]
    policy.on_routed(request, chosen, request_id)
    policy.on_completed(request_id)
    policy.check_invariants()
    return chosen


def next_turn(previous_prompt, seed):
    """Previous prompt + its answer (4 tokens) + a new question (8)."""
    return previous_prompt + tokens(seed, 4) + tokens(seed + 1, 8)


@pytest.mark.parametrize("sub", [SUB, 0])
def test_a_chat_turn_follows_its_previous_turns_partial_block(sub):
    """Turn 2 shares only SYSTEM's full blocks with everyone, plus turn 1's
    8-token partial block with the replica that served turn 1. Without the
    within-block match the recent-work tie-break sends it to the other one."""
    policy = make_policy(sub_block_tokens=sub)
    turn_1 = SYSTEM + tokens(1, 8)
    first = serve(policy, chat_request(turn_1), "t1")
    turn_2 = next_turn(turn_1, 2)
    assert len(block_hashes(turn_2, BLOCK)) == 3  # block 2 holds turn 1's tail and more: unknown
    second = serve(policy, chat_request(turn_2), "t2")
    assert (second == first) is bool(sub)


def test_the_within_block_match_yields_to_a_replica_that_is_much_less_loaded():
    policy = make_policy()
    turn_1 = SYSTEM + tokens(1, 8)
    first = serve(policy, chat_request(turn_1), "t1")
    for i in range(3):  # queued work on the first replica, not completed
        busy = chat_request(tokens(50 + i, 3 * BLOCK))
        policy.on_routed(busy, first, f"busy-{i}")
    assert policy.rank(chat_request(next_turn(turn_1, 2)))[0] != first


@pytest.mark.parametrize("min_tokens", [4, 8])
def test_a_prompt_sent_away_from_its_partial_block_is_hinted_to_fetch_it(min_tokens):
    """Both replicas hold SYSTEM, so when load sends a repeated prompt away
    from the replica that served it, the plain rule can only name a holder of
    SYSTEM (a backup hint). The within-block hint names the replica that
    served it, for SYSTEM and the 8 tokens of the partial block it is known
    to share, where those 8 are more than ``fetch_min_tokens``; the ranking
    is the plain rule's either way."""
    policy = make_policy(fetch_min_tokens=min_tokens)
    prompt = SYSTEM + tokens(1, 10)
    first = serve(policy, chat_request(prompt), "t1")
    for i in range(3):  # queued work on the first replica, not completed
        policy.on_routed(chat_request(tokens(50 + i, 3 * BLOCK)), first, f"busy-{i}")
    decision = policy.decide(chat_request(prompt))
    assert decision.ranked[0] != first
    if min_tokens < 8:
        assert decision.fetch == FetchHint(first, 2 * BLOCK + 8)
    else:
        assert decision.fetch is None or decision.fetch.num_tokens == 2 * BLOCK


def test_no_within_block_credit_where_the_replica_lost_the_full_blocks_before_it():
    clock = Clock()
    policy = make_policy(clock)
    turn_1 = SYSTEM + tokens(1, 8)
    first = serve(policy, chat_request(turn_1), "t1")
    other = "y" if first == "x" else "x"
    clock.now = 100.0  # past the grace period: the summary's word stands
    radix = RadixCache(10_000, BLOCK)
    radix.insert(tokens(77, BLOCK))
    policy.on_summary(CacheSummary.from_radix(radix, BLOCK, replica_id=first, version=10, timestamp_s=0.0))
    assert policy.rank(chat_request(next_turn(turn_1, 2)))[0] == other


def test_tenants_do_not_share_within_block_affinity():
    policy = make_policy()
    short = tokens(1, 8)  # shorter than a block: keyed under the tenant's salt
    first = serve(policy, chat_request(short, salt="tenant-a"), "a")
    assert policy._within_block(chat_request(short + tokens(3, 4), salt="tenant-a"), 0) == (first, 8)
    assert policy._within_block(chat_request(short + tokens(3, 4), salt="tenant-b"), 0) is None


def test_requests_without_token_ids_route_as_before():
    policy = make_policy()
    bare = RoutingRequest(tuple(block_hashes(SYSTEM + tokens(1, 8), BLOCK)), 2 * BLOCK + 8)
    assert policy.rank(bare)[0] in {"x", "y"}
    policy.on_routed(bare, "x", "r1")
    policy.check_invariants()
