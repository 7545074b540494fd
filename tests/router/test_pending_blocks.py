"""Blocks promised to a replica by requests still in flight (router.pending_blocks),
and the premium the policy withholds from them (premium_needs_completion)."""

import dataclasses
import random

import pytest

from router.cache_fill import FleetCacheFill
from router.pending_blocks import PendingBlocks
from tests.router.test_policy import EARLIER_BALANCE, REPLICAS, make_policy, prompt, request, summary


def test_computed_depth_is_the_leading_blocks_no_request_in_flight_still_computes():
    pending = PendingBlocks(timeout_s=10.0)
    chain = [11, 12, 13, 14, 15, 16]
    pending.add("a", "r0", chain[2:], now=0.0)  # r0 held blocks 0-1, "a" computes 2-5
    pending.add("b", "r0", chain[4:], now=1.0)  # a second request over the same tail
    pending.check_invariants()
    assert pending.computed_depth("r0", chain, 6) == 2
    assert pending.computed_depth("r0", chain, 2) == 2
    assert pending.computed_depth("r1", chain, 6) == 6  # nothing pending there
    assert pending.computes("r0", chain, 3) and not pending.computes("r0", chain, 2)
    assert not pending.computes("r1", chain, 6)
    pending.done("a")
    assert pending.computed_depth("r0", chain, 6) == 4  # "b" still computes 4-5
    pending.add("b", "r1", chain, now=2.0)  # counted again elsewhere: moved
    assert not pending.has_pending("r0") and pending.computed_depth("r1", chain, 6) == 0
    pending.check_invariants()
    pending.add("c", "r0", [99], now=12.5)  # "b" (added at 2.0) is past the 10-s timeout
    assert pending.has_pending("r0") and not pending.has_pending("r1") and len(pending) == 1
    pending.remove_replica("r0")
    assert len(pending) == 0
    pending.check_invariants()


@pytest.mark.parametrize(("needs_completion", "min_users"), [(False, 4), (True, 2), (True, 4)])
def test_a_burst_of_chats_on_one_system_prompt_splits_only_when_the_premium_waits_for_completion(needs_completion,
                                                                                                  min_users):
    """Eight chats on a shared 256-token system prompt arrive at once on two
    idle replicas (each decided with its request id before any completes),
    priced as the live CPU Workers measure (an output token keeps a replica
    busy 40 prefill tokens' worth, delays a queued request 4). With the
    premium on promised blocks the first chat's replica draws the others
    (~14x the system prompt against ~100 tokens of queue each, until the
    load bound would stop it: here all eight); without it they split four
    and four, whether two or four waiting requests make a burst
    (``premium_pending_min_users``: with 4 the fifth chat is the first sent
    away, with 2 the third). Once the
    first has completed, the premium draws the next chats to it either way."""
    # replicate_hot_prefixes and queued copies off: they would split the burst too (tests/router/test_replication.py)
    policy = make_policy(replicas=REPLICAS[:2], premium_needs_completion=needs_completion,
                         premium_pending_min_users=min_users, queue_decode_token_cost=4.0,
                         replicate_hot_prefixes=False, queue_copy_requests=0, **EARLIER_BALANCE)
    system = prompt(7, 256)
    chats = [request(system + prompt(100 + i, 32), num_output_tokens=16) for i in range(8)]
    chosen = [policy.rank(chat, request_id=f"chat{i}")[0] for i, chat in enumerate(chats)]
    policy.check_invariants()
    counts = sorted(chosen.count(r) for r in REPLICAS[:2])
    assert counts == ([4, 4] if needs_completion else [0, 8])
    for i in range(8):
        policy.on_completed(f"chat{i}")
    policy.check_invariants()
    # a computed prefix earns its premium: after the first chat completes, the next three follow it
    policy = make_policy(replicas=REPLICAS[:2], premium_needs_completion=needs_completion,
                         queue_decode_token_cost=4.0, replicate_hot_prefixes=False, hot_affinity_weight=None,
                         queue_copy_requests=0)
    first = policy.rank(chats[0], request_id="first")[0]
    policy.on_completed("first")
    assert [policy.rank(chat, request_id=f"next{i}")[0] for i, chat in enumerate(chats[1:4])] == [first] * 3


def test_the_cache_pressure_is_the_budget_share_of_full_caches():
    fill = FleetCacheFill()
    assert fill.pressure == 0.0  # nothing reported: every cache has room
    fill.report("r0", 9_600, 10_000)  # 96 %: full
    fill.report("r1", 9_000, 10_000)  # 90 %: room
    fill.report("r2", 50_000, 20_000)  # over its budget (clamped): full
    assert fill.pressure == pytest.approx(30_000 / 40_000)
    fill.report("r1", 0, 0)  # no budget reported: left out
    assert fill.pressure == 1.0
    fill.remove("r2")
    fill.remove("r-unknown")
    assert fill.pressure == 1.0
    fill.check_invariants()
    fill.remove("r0")
    assert fill.pressure == 0.0
    fill.report("r0", 9_600, 10_000)
    fill.report("r1", 9_600, 10_000)
    fill.report("r0", 100, 10_000)  # a later report replaces the earlier: r0 has room again
    assert fill.pressure == pytest.approx(0.5)
    assert fill.min_free_tokens() == 400  # the tightest cache's room (r1), what fifo_work_left weighs
    fill.check_invariants()
    assert FleetCacheFill().min_free_tokens() is None


def test_the_least_free_budget_follows_every_report_and_removal():
    """``min_free_tokens`` is kept from report to report (read on the
    decision path) and taken afresh only after the report that had the least
    was replaced or removed: it matches a scan of the reports at every step."""
    rng = random.Random(3)
    fill = FleetCacheFill()
    for _ in range(2000):
        replica_id = f"r{rng.randrange(6)}"
        if rng.random() < 0.15:
            fill.remove(replica_id)
        else:
            fill.report(replica_id, rng.randrange(0, 12_000), rng.choice([0, 10_000, 20_000]))
        if rng.random() < 0.5:
            reports = fill._reports.values()  # noqa: SLF001
            assert fill.min_free_tokens() == min((b - c for c, b in reports), default=None)
        fill.check_invariants()


def test_once_every_cache_is_full_the_premium_counts_pending_blocks_again():
    """A second copy of a prefix costs its prefill and, once the caches are
    full, the room it takes from what they hold: then the premium on a
    prefix still being computed is what it was without the rule."""
    chats = [request(prompt(7, 256) + prompt(100 + i, 32), num_output_tokens=16) for i in range(8)]
    chosen = {}
    for needs_completion in (False, True):
        policy = make_policy(replicas=REPLICAS[:2], premium_needs_completion=needs_completion,
                             queue_decode_token_cost=4.0, **EARLIER_BALANCE)
        for replica_id in REPLICAS[:2]:
            policy.on_summary(dataclasses.replace(summary(replica_id, 1, []), num_cached_tokens=10_000))
        chosen[needs_completion] = [policy.rank(chat, request_id=f"chat{i}")[0] for i, chat in enumerate(chats)]
        policy.check_invariants()
    assert chosen[True] == chosen[False] and len(set(chosen[True])) == 1


def test_users_count_the_requests_waiting_on_a_pending_block_until_each_completes():
    pending = PendingBlocks(timeout_s=10.0)
    pending.add("first", "r0", [1, 2, 3], now=0.0, anchor=1)  # computes 1-3
    pending.add("second", "r0", [4], now=0.0, anchor=1)  # matched 1-3 while pending, computes 4
    pending.add("elsewhere", "r1", [1, 2, 3], now=0.0, anchor=1)
    assert pending.users("r0", 1) == 2 and pending.users("r1", 1) == 1 and pending.users("r0", 4) == 0
    pending.check_invariants()
    pending.done("first")
    assert pending.users("r0", 1) == 1
    pending.add("second", "r1", [], now=1.0, anchor=1)  # counted again elsewhere
    assert pending.users("r0", 1) == 0 and pending.users("r1", 1) == 2
    pending.check_invariants()


def test_a_pending_prefix_keeps_its_premium_unless_its_waiting_requests_are_more_than_one_replicas_share():
    """The premium is withheld only while at least ``premium_pending_min_users`` in-flight requests
    at the replica wait on the pending prefix and they are more than one
    replica's share of this router's requests in flight. A burst of chats on
    one system prompt splits; a burst of eight groups on two replicas, two
    prompts each sent one after the other, keeps every group's pair
    together, as without the rule (withholding the premium from every
    pending block would send the second of each pair away from its first,
    whose replica has more queued: all 8 pairs split, BENCHMARKS.md)."""
    groups = [request(prompt(10 + g, 256) + prompt(300 + 2 * g + k, 32), num_output_tokens=16)
              for g in range(8) for k in range(2)]  # each group's two prompts one after the other
    placed = {}
    for needs_completion, min_users in ((False, 4), (True, 2), (True, 4)):
        policy = make_policy(replicas=REPLICAS[:2], premium_needs_completion=needs_completion,
                             premium_pending_min_users=min_users, queue_decode_token_cost=4.0)
        placed[needs_completion, min_users] = [policy.rank(r, request_id=f"g{i}")[0] for i, r in enumerate(groups)]
        policy.check_invariants()
    for rule in ((True, 2), (True, 4)):
        assert all(placed[rule][2 * g] == placed[rule][2 * g + 1] for g in range(8))
        assert sorted(placed[rule].count(r) for r in REPLICAS[:2]) == [8, 8]
