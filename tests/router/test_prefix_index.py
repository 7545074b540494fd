"""router.PrefixIndex: learned at once, corrected by summaries, bounded, O(prompt blocks)."""

import random

import pytest

from router import PrefixIndex
from router.fifo_runs import fifo_items as _items


def chain(*ids):
    return list(ids)


def test_learned_blocks_are_found_at_once_with_their_depth():
    index = PrefixIndex()
    index.learn("a", [1, 2, 3], now=0.0)
    index.learn("b", [1, 2, 7], now=0.0)
    index.check_invariants()
    assert index.deepest_holders([1, 2, 3, 4], 4) == (3, {"a": 3, "b": 2})
    assert index.deepest_holders([1, 2, 7], 4) == (3, {"b": 3, "a": 2})
    assert index.deepest_holders([9, 1], 4) == (0, {})
    assert index.deepest_holders([1, 2, 3], 1) == (3, {"a": 3})


def holder_levels(index, path):
    levels = []
    index.deepest_holders(path, 0, levels=levels)
    return levels


def test_holder_levels_count_the_holders_of_each_run_deepest_first():
    index = PrefixIndex()
    index.learn("a", [1, 2, 3, 4, 5, 6], now=0.0)  # a conversation's history
    index.learn("b", [1, 2, 3, 4], now=0.0)  # its system prompt and first turn
    index.learn("c", [1, 2], now=0.0)  # the system prompt
    index.learn("d", [1, 2], now=0.0)
    index.check_invariants()
    assert holder_levels(index, [1, 2, 3, 4, 5, 6, 7]) == [(6, 1), (4, 2), (2, 4)]
    assert holder_levels(index, [1, 2, 3, 8]) == [(3, 2), (2, 4)]
    assert holder_levels(index, [1, 2, 9]) == [(2, 4)]
    assert holder_levels(index, [9]) == []
    levels = []  # filled by the walk that finds the holders, which goes on past max_replicas for it
    assert index.deepest_holders([1, 2, 3, 4, 5, 6], 1, levels=levels) == (6, {"a": 6})
    assert levels == [(6, 1), (4, 2), (2, 4)]


def test_live_filter_skips_replicas_the_caller_cannot_reach():
    index = PrefixIndex()
    index.learn("a", [1, 2, 3], now=0.0)
    index.learn("b", [1], now=0.0)
    assert index.deepest_holders([1, 2, 3], 4, live={"b"}) == (3, {"b": 1})


def test_fresh_summary_replaces_stale_entries():
    index = PrefixIndex(learned_grace_s=5.0)
    index.learn("a", [1, 2, 3], now=0.0)
    index.apply_summary("a", {1, 2}, now=10.0)  # block 3 was evicted
    index.check_invariants()
    assert index.deepest_holders([1, 2, 3], 4) == (2, {"a": 2})
    assert not index.holds("a", 3)


def test_summary_keeps_blocks_learned_after_it_may_have_been_taken():
    index = PrefixIndex(learned_grace_s=5.0)
    index.learn("a", [1, 2, 3], now=8.0)
    index.apply_summary("a", {1}, now=10.0)  # taken before the request ran
    assert index.deepest_holders([1, 2, 3], 4) == (3, {"a": 3})
    index.apply_summary("a", {1}, now=20.0)  # still not there later: gone
    assert index.deepest_holders([1, 2, 3], 4) == (1, {"a": 1})
    index.check_invariants()


def test_summary_adds_what_the_router_never_routed():
    index = PrefixIndex()
    index.apply_summary("b", {11, 12}, now=0.0)
    assert index.deepest_holders([11, 12, 13], 4) == (2, {"b": 2})


def test_capacity_evicts_least_recent_and_descendants_before_ancestors():
    index = PrefixIndex(max_blocks_per_replica=4)
    index.learn("a", [1, 2, 3], now=0.0)
    index.learn("a", [1, 5], now=1.0)  # touches 1 again; now 1, 5 most recent
    index.check_invariants()
    assert index.num_blocks("a") == 4
    index.learn("a", [8], now=2.0)  # evicts 3 (the oldest), not its ancestor 2
    index.check_invariants()
    assert [index.holds("a", h) for h in (1, 2, 3, 5, 8)] == [True, True, False, True, True]
    index.learn("a", [9], now=3.0)  # then 2
    assert not index.holds("a", 2) and index.holds("a", 1)


def test_a_learn_leaves_up_to_the_slack_past_capacity_and_the_next_summary_trims_it():
    """Capacity 80, slack 10: learns trim only what passes 90 (least recent
    first, deepest blocks before their ancestors); a summary trims to 80."""
    index = PrefixIndex(max_blocks_per_replica=80, learn_slack_share=0.125)
    assert index.learn_slack("a") == 10
    index.learn("a", list(range(1, 81)), now=0.0)  # block 80 is the least recent, 1 the most
    index.learn("a", list(range(101, 111)), now=1.0)
    index.check_invariants()
    assert index.num_blocks("a") == 90 and index.holds("a", 80)  # within the slack: nothing trimmed
    index.learn("a", list(range(201, 206)), now=2.0)
    index.check_invariants()
    assert index.num_blocks("a") == 90
    assert not any(index.holds("a", h) for h in range(76, 81)) and index.holds("a", 75)
    held = {h for h in [*range(1, 76), *range(101, 111), *range(201, 206)]}
    index.apply_summary("a", held, now=3.0)
    index.check_invariants()
    assert index.num_blocks("a") == 80  # the summary trims to the capacity
    assert not any(index.holds("a", h) for h in range(66, 76)) and index.holds("a", 65)


def test_without_slack_a_learn_trims_to_the_capacity():
    index = PrefixIndex(max_blocks_per_replica=80, learn_slack_share=0.0)
    index.learn("a", list(range(1, 86)), now=0.0)
    index.check_invariants()
    assert index.num_blocks("a") == 80 and not index.holds("a", 81) and index.holds("a", 80)


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_bad_learn_slack_share(share):
    with pytest.raises(ValueError, match="learn_slack_share"):
        PrefixIndex(learn_slack_share=share)


def test_a_rebuilt_fifo_keeps_the_eviction_order():
    """Learning one path again and again leaves stale FIFO items; past 4,096
    the FIFO is rebuilt from its current items, in the same order: reported
    blocks first, then the path deepest block first."""
    index = PrefixIndex(max_blocks_per_replica=12, learn_slack_share=0.0)
    index.apply_summary("a", {500, 400}, now=0.0)
    path = list(range(1, 11))
    for step in range(450):
        index.learn("a", path, now=1.0 + step)
    index.check_invariants()
    assert index._fifo_size["a"] < 4096 + 8 * 12  # rebuilt on the way
    entries = index.ticks("a")
    assert [h for t, h in _items(index._fifo["a"]) if entries.get(h) == t] == [400, 500, *path[::-1]]
    evicted = []
    for new_block in range(1000, 1012):
        index.learn("a", [new_block], now=500.0)
        evicted.append(next(h for h in [400, 500, *path] if h not in evicted and not index.holds("a", h)))
    assert evicted == [400, 500, *path[::-1]]


def test_a_block_a_summary_deleted_and_reported_again_is_trimmed_once():
    """A summary deletes reported block 13 (its FIFO item stays queued); the
    next reports it again, a second tick-0 item. A trim that walks past both
    takes 13 once (before: it took it twice and raised KeyError)."""
    index = PrefixIndex(max_blocks_per_replica=100)
    index.apply_summary("a", {13, 12, 11}, now=1.0)
    index.apply_summary("a", {12, 11}, now=2.0)
    index.apply_summary("a", {13, 12, 11}, now=3.0)
    index.apply_summary("a", {13, 12, 11}, now=4.0, capacity_blocks=1)
    index.check_invariants()
    assert index.num_blocks("a") == 1 and index.holds("a", 11) and index.num_holders(13) == 0


@pytest.mark.parametrize("seed", range(8))
def test_bounded_index_keeps_its_invariants_through_summaries_that_drop_and_re_report(seed):
    """Small capacities, summaries (full and delta) that drop blocks and
    report them again, learns between them: the index never raises, keeps
    its invariants, and holds only what its last summary reported or it
    learned since."""
    rng = random.Random(seed)
    index = PrefixIndex(max_blocks_per_replica=rng.choice([4, 8, 16]), learned_grace_s=1.5,
                        learn_slack_share=rng.choice([0.0, 0.25]))
    paths = [[1]]
    for node in range(2, 40):
        parent = rng.choice(paths)
        paths.append(parent[: rng.randrange(1, len(parent) + 1)] + [node])
    last_reported: dict[str, set[int]] = {}
    learned_at: dict[str, dict[int, float]] = {}
    for step in range(300):
        now = float(step)
        replica = rng.choice("ab")
        if rng.random() < 0.4:
            path = rng.choice(paths)
            index.learn(replica, path, now)
            learned_at.setdefault(replica, {}).update(dict.fromkeys(path, now))
        else:
            reported = set()
            for path in rng.sample(paths, rng.randrange(0, 4)):
                reported.update(path)
            before = last_reported.get(replica)
            if before is not None and rng.random() < 0.5:
                index.apply_delta(replica, reported - before, before - reported, reported, now,
                                  capacity_blocks=rng.choice([None, 6, 12]))
            else:
                index.apply_summary(replica, reported, now, capacity_blocks=rng.choice([None, 6, 12]))
            last_reported[replica] = reported
        index.check_invariants()
        for r in "ab":
            held = {h for h in paths[-1] + [n for p in paths for n in p] if index.holds(r, h)}
            allowed = last_reported.get(r, set()) | set(learned_at.get(r, {}))
            assert held <= allowed, (r, held - allowed)


def test_summary_budget_lowers_the_capacity():
    index = PrefixIndex(max_blocks_per_replica=100)
    index.apply_summary("a", {1, 2, 3}, now=0.0, capacity_blocks=2)
    index.check_invariants()
    assert index.capacity_blocks("a") == 2 and index.num_blocks("a") == 2


def test_remove_replica_forgets_it_everywhere():
    index = PrefixIndex()
    index.learn("a", [1, 2], now=0.0)
    index.learn("b", [1, 2], now=0.0)
    index.remove_replica("a")
    index.check_invariants()
    assert index.deepest_holders([1, 2], 4) == (2, {"b": 2})
    index.remove_replica("b")
    index.check_invariants()
    assert index.deepest_holders([1, 2], 4) == (0, {})


@pytest.mark.parametrize("kwargs", [{"max_blocks_per_replica": 0}, {"max_blocks_per_replica": 1.5},
                                    {"learned_grace_s": -1}])
def test_bad_config(kwargs):
    with pytest.raises(ValueError):
        PrefixIndex(**kwargs)


def test_bad_summary_capacity():
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex().apply_summary("a", {1}, now=0.0, capacity_blocks=0)


def test_randomized_against_a_naive_reference():
    """Unbounded capacity: after any sequence of learns, summaries and
    removals the index answers like a plain dict of sets. Paths are chains of
    a random tree and summaries report prefix-closed sets, as real chained
    hashes and radix trees do."""
    rng = random.Random(7)
    index = PrefixIndex(learned_grace_s=2.0)
    naive: dict[str, dict[int, float | None]] = {}
    paths = [[1]]
    for node in range(2, 60):  # each new block extends a random existing path
        parent = rng.choice(paths)
        paths.append(parent[: rng.randrange(1, len(parent) + 1)] + [node])
    for step in range(400):
        now = float(step)
        replica = rng.choice("abcd")
        action = rng.random()
        if action < 0.6:
            path = rng.choice(paths)
            index.learn(replica, path, now)
            naive.setdefault(replica, {}).update({h: now for h in path})
        elif action < 0.9:
            reported = set()
            for path in rng.sample(paths, rng.randrange(0, 5)):
                reported.update(path)
            index.apply_summary(replica, reported, now)
            old = naive.get(replica, {})
            kept = {h: t for h, t in old.items() if h not in reported and t is not None and t > now - 2.0}
            naive[replica] = {**{h: None for h in reported}, **kept}
        else:
            index.remove_replica(replica)
            naive.pop(replica, None)
        index.check_invariants()
        for path in paths[::5]:
            num_known, found = index.deepest_holders(path, 10)
            expected_known, expected = _reference(path, naive)
            assert num_known == expected_known
            assert found == expected
            for r in "abcd":
                held = naive.get(r, {})
                run = 0
                while run < len(path) and path[run] in held:
                    run += 1
                assert index.depth(r, path) == run
            counts = [sum(path[d] in held for held in naive.values()) for d in range(num_known)]
            if all(x >= y for x, y in zip(counts, counts[1:])):  # held prefix by prefix (the usual case)
                levels = [(d + 1, counts[d]) for d in range(num_known - 1, -1, -1)
                          if d == num_known - 1 or counts[d] != counts[d + 1]]
                assert holder_levels(index, path) == levels
                walked = []
                assert index.deepest_holders(path, 2, levels=walked) == index.deepest_holders(path, 2)
                assert walked == levels


def _reference(path, naive):
    """What deepest_holders promises: the leading run of blocks someone holds,
    and per replica the deepest block of that run it holds."""
    num_known = 0
    while num_known < len(path) and any(path[num_known] in held for held in naive.values()):
        num_known += 1
    found = {}
    for depth in range(num_known, 0, -1):
        for r, held in naive.items():
            if path[depth - 1] in held and r not in found:
                found[r] = depth
    return num_known, found


def _state(index):
    """Everything a decision or a later trim reads: per replica its entries
    and their ticks, who holds what, and the FIFO's current items in order."""
    fifo = {r: [(t, h) for t, h in _items(index._fifo[r]) if index.ticks(r).get(h) == t]
            for r in index.replica_ids}
    return {r: index.ticks(r) for r in index.replica_ids}, dict(index._holders), fifo


@pytest.mark.parametrize("capacity", [None, 12, 30])
@pytest.mark.parametrize("seed", range(6))
def test_a_delta_leaves_the_entries_a_full_summary_would(seed, capacity):
    """apply_delta against apply_summary of the same reported sets, with learns
    (some confirmed later, some never, some dropped by the replica) and the
    grace period passing between summaries; with a capacity the index trims
    reported blocks for learned ones, and a delta (which names only what
    changed) must put back those the replica still reports, in the same
    least-recent order, as the full summary does."""
    rng = random.Random(seed)
    full, delta = PrefixIndex(learned_grace_s=2.0), PrefixIndex(learned_grace_s=2.0)
    reported = {r: set() for r in ("a", "b")}
    now = 0.0
    num_restored = 0
    for step in range(120):
        now += rng.choice([0.3, 1.0, 2.5])
        replica = rng.choice("ab")
        if rng.random() < 0.5:
            chain = [rng.randrange(200) * 1000 + depth for depth in range(rng.randrange(1, 6))]
            full.learn(replica, chain, now)
            delta.learn(replica, chain, now)
            continue
        before = set(reported[replica])
        after = set(before)
        after -= set(rng.sample(sorted(after), min(len(after), rng.randrange(4))))
        learned = [h for h in full.ticks(replica) if h not in after]
        after |= set(rng.sample(learned, min(len(learned), rng.randrange(3))))  # learned blocks confirmed
        after |= {rng.randrange(10**6, 2 * 10**6) for _ in range(rng.randrange(4))}  # blocks the router never routed
        if capacity is not None:  # what a replica of that budget can hold
            after = set(sorted(after)[:capacity])
        reported[replica] = after
        full.apply_summary(replica, frozenset(after), now, capacity)
        if step == 0 or replica not in delta._applied_tick:
            delta.apply_summary(replica, frozenset(after), now, capacity)
        else:
            trimmed_held = (after & before) - delta.ticks(replica).keys()  # only the trimmed can be missing
            delta.apply_delta(replica, frozenset(after - before), frozenset(before - after), after, now, capacity)
            num_restored += len(trimmed_held & delta.ticks(replica).keys())
        assert _state(delta) == _state(full), step
        delta.check_invariants()
    if capacity is None:
        assert num_restored == 0  # nothing is trimmed
    elif capacity == 12:
        assert num_restored > 0  # the tight runs exercise the put-back


def test_a_delta_puts_back_a_reported_block_the_index_trimmed_for_a_learned_one():
    """The replica holds 1 and 2 (capacity 2); the router learns 3 there, so
    its index trims a reported block. The replica never took 3 (say the
    request failed) and keeps reporting 1 and 2; its next deltas name only
    what changed (nothing), yet once 3's grace period is over the index must
    hold 1 and 2 again, as a full summary would leave it."""
    index = PrefixIndex(learned_grace_s=1.0)
    index.apply_summary("a", frozenset({1, 2}), 0.0, capacity_blocks=2)
    index.learn("a", [3], 0.5)
    assert index.num_blocks("a") == 2 and index.holds("a", 3)
    trimmed = {1, 2} - set(index.ticks("a"))
    assert len(trimmed) == 1
    index.apply_delta("a", frozenset(), frozenset(), {1, 2}, 1.0)  # 3 within its grace: kept
    assert index.holds("a", 3) and not any(index.holds("a", h) for h in trimmed)
    index.apply_delta("a", frozenset(), frozenset(), {1, 2}, 2.0)  # 3 expired: the trimmed block is back
    assert not index.holds("a", 3) and index.holds("a", 1) and index.holds("a", 2)
    index.check_invariants()


def test_a_delta_before_any_summary_is_applied_as_a_full_one():
    index = PrefixIndex()
    index.learn("a", [1, 2, 3], 0.0)
    index.apply_delta("a", frozenset({7}), frozenset(), {7}, 10.0)
    assert index.holds("a", 7) and not index.holds("a", 1)
    index.check_invariants()


def test_prompts_branch_at_a_block_learned_inside_a_prompt_never_at_its_end():
    """``is_branch_point``: a shared system prompt's last block, which every
    prompt learned continues past, is one; a chat turn's last block, where
    its next turn continues, is not; nor a block only a summary reported
    (an answer's), nor one nobody holds. Forgotten with its last holder
    (invariant 5)."""
    index = PrefixIndex()
    index.learn("a", (1, 2, 3), 0.0)  # a prompt: blocks 1 and 2 inside it, 3 its last
    assert index.is_branch_point(1) and index.is_branch_point(2)
    assert not index.is_branch_point(3) and not index.is_branch_point(99)
    index.apply_summary("b", [1, 2, 3, 4], 1.0)  # 4: reported only (an answer's block)
    assert not index.is_branch_point(4)
    index.learn("b", (1, 2), 2.0)  # a prompt ending at block 2: a chat's history now ends there
    assert not index.is_branch_point(2) and index.is_branch_point(1)
    index.check_invariants()
    index.remove_replica("a")
    index.remove_replica("b")
    assert not index.is_branch_point(1) and not index._prompt_ends
    index.learn("c", (1, 2, 5), 3.0)  # learned afresh after it was forgotten: a branch point again
    assert index.is_branch_point(2)
    index.check_invariants()


def test_a_learn_leaves_the_replicas_entries_alone_until_its_next_summary_folds_them_in():
    """A learn writes the replica's young dict, never its entries (a dict the
    cache's size, whose rebuild a learn would pay); queries see the young
    blocks at once, and the next summary (or delta) folds them in, their
    ticks winning, off the decision path."""
    index = PrefixIndex(learned_grace_s=10.0)
    index.apply_summary("a", frozenset(range(100, 140)), now=0.0)
    entries = index._entries["a"]
    before = dict(entries)
    index.learn("a", [100, 101, 7, 8], now=1.0)  # two reported blocks learned again, two new ones
    index.learn("b", [100, 9], now=1.0)
    index.check_invariants()
    assert index._entries["a"] is entries and entries == before
    assert index.num_blocks("a") == 42 and index.depth("a", [100, 101, 7, 8]) == 4
    assert index.ticks("a")[100] > 0 and index.ticks("a")[120] == 0  # the learn's tick wins
    assert index.is_branch_point(101) and index.is_branch_point(7) and not index.is_branch_point(8)
    index.apply_delta("a", frozenset({7}), frozenset(), frozenset(range(100, 140)) | {7}, now=2.0)
    index.check_invariants()
    assert not index._young["a"] and index._entries["a"] == index.ticks("a")
    assert set(index.ticks("a")) == set(range(100, 140)) | {7, 8} and index.ticks("a")[8] > 0
    index.remove_replica("a")
    index.check_invariants()
    assert index.num_holders(7) == 0 and index.num_holders(100) == 1  # "b" holds it


def test_a_fifo_rebuilt_between_summaries_keeps_the_young_blocks_evictable():
    """Learning one path again and again fills the FIFO with stale items
    until it is rebuilt from the current ones. Without a summary every
    block learned sits in the young dict; a block learned once before that
    (and not since) must keep its FIFO item through the rebuild, or it
    could never be evicted."""
    index = PrefixIndex()
    once, again = [1, 2, 3, 4, 5], list(range(100, 110))
    index.learn("a", once, now=0.0)
    for step in range(430):
        index.learn("a", again, now=1.0 + step)
        index.check_invariants()
    assert index._fifo_size["a"] < 4096  # rebuilt on the way
    current = [h for t, h in _items(index._fifo["a"]) if index.ticks("a").get(h) == t]
    assert current == [*once[::-1], *again[::-1]]  # least recent first, deepest block first
