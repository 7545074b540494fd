"""Routers sharing their decisions: the shared log, what a router sends, how
the policy books another router's decision, and the simulated effect."""

from __future__ import annotations

import json

import pytest

from cache import block_hashes
from harness.workloads import build_workload
from cache.summary import CacheSummary
from router.batching import StepProfile
from router.closed_loop import ClosedLoopConfig
from router.policy_config import PolicyConfig
from router.request import RoutingRequest
from router.shared_decisions import DecisionLog, PeerDecision
from router.simulate import SimConfig, replay
from router.workload import from_sessions
from tests.router.fake_clock import Clock
from tests.router.test_cold_home import BLOCK, REPLICAS, make_policy, report
from tests.router.test_reported_busy import with_history


# ------------------------------------------------------------------ the log
def test_an_exchange_returns_the_other_routers_events_since_the_last_one_in_order():
    log = DecisionLog()
    assert log.exchange("a", ["a1"], None, 0.0) == ([], 1)
    found, since_b = log.exchange("b", ["b1", "b2"], None, 0.1)  # joins: the others' last join_window_s
    assert found == ["a1"] and since_b == 3
    found, since_a = log.exchange("a", ["a2"], 1, 0.2)
    assert found == ["b1", "b2"] and since_a == 4  # never its own
    assert log.exchange("b", [], since_b, 0.3) == (["a2"], 4)
    assert log.exchange("a", [], since_a, 0.4) == ([], 4)


def test_a_joining_router_books_only_the_last_join_window():
    log = DecisionLog(join_window_s=2.0)
    log.exchange("a", ["old"], None, 0.0)
    log.exchange("a", ["recent"], 0, 9.0)
    assert log.exchange("b", [], None, 10.0) == (["recent"], 2)


def test_the_log_holds_the_last_max_events_and_counts_what_a_late_router_missed():
    log = DecisionLog(max_events=3)
    _, since = log.exchange("b", [], None, 0.0)
    log.exchange("a", ["e1", "e2", "e3", "e4", "e5"], None, 0.0)
    assert len(log) == 3
    assert log.exchange("b", [], since, 0.1) == (["e3", "e4", "e5"], 5)
    assert log.num_missed == 2


@pytest.mark.parametrize("kwargs", [{"max_events": 0}, {"max_events": 1.5}, {"join_window_s": -1.0},
                                    {"join_window_s": float("inf")}])
def test_bad_log_config(kwargs):
    with pytest.raises(ValueError):
        DecisionLog(**kwargs)


# ---------------------------------------------------------- what a router sends
def routing(tokens, num_output_tokens=16, salt=None):
    return RoutingRequest(tuple(block_hashes(tokens, BLOCK, salt)), len(tokens), salt, "the text", num_output_tokens,
                          tuple(tokens))


def test_a_peer_decision_carries_the_blocks_and_the_partial_tail_not_the_prompt():
    tokens = list(range(1000, 1000 + 3 * BLOCK + BLOCK // 2))
    decision = PeerDecision.of(routing(tokens), "r1", BLOCK)
    assert decision.replica_id == "r1" and decision.tail_token_ids == tuple(tokens[3 * BLOCK:])
    assert len(decision.tail_token_ids) == BLOCK // 2
    assert decision.request.block_hashes == routing(tokens).block_hashes
    assert decision.request.token_ids == () and decision.request.prompt == ""
    assert decision.request.num_prompt_tokens == len(tokens) and decision.request.num_output_tokens == 16
    assert PeerDecision.of(object(), "r1", BLOCK) is None  # no routing attributes: nothing to share
    assert PeerDecision.from_wire(decision.to_wire()) == decision
    assert all(type(v) in (str, int, tuple, type(None)) for v in decision.to_wire())


# ------------------------------------------------------------ the policy's side
def test_a_peer_decision_is_learned_and_counted_as_recent_work_without_an_in_flight_entry():
    clock = Clock()
    policy = make_policy(clock)
    tokens = list(range(5000, 5000 + 4 * BLOCK + 3))
    decision = PeerDecision.of(routing(tokens), REPLICAS[2], BLOCK)
    policy.on_peer_routed(decision.request, decision.replica_id, decision.tail_token_ids)
    assert policy.index.depth(REPLICAS[2], decision.request.block_hashes) == 4
    assert policy.loads.recent_work(REPLICAS[2], clock.now) > 0
    assert policy.loads.num_in_flight() == 0
    assert policy.routing_status()["peer_decisions"] == 1
    for seed, replica_id in enumerate(REPLICAS):  # the same work everywhere else: only the prefix differs
        if replica_id != REPLICAS[2]:
            first = 10**5 * (seed + 1)
            other = PeerDecision.of(routing(list(range(first, first + len(tokens)))), replica_id, BLOCK)
            policy.on_peer_routed(other.request, other.replica_id, other.tail_token_ids)
    follow_up = routing(tokens + list(range(7, 7 + BLOCK)))  # the chat's next turn: the peer's replica
    assert policy.rank(follow_up)[0] == REPLICAS[2]
    policy.on_peer_routed(decision.request, "a replica that left", ())
    assert policy.routing_status()["peer_decisions"] == len(REPLICAS)  # the last one ignored
    policy.check_invariants()


@pytest.mark.parametrize("on", [True, False])
def test_a_peer_decision_is_queued_work_at_its_replica_until_the_next_report(on):
    """The other router's request waits at its replica until that replica
    reports its queue: this router counts it there meanwhile, so it does not
    send the next request to the same replica as if it were idle."""
    clock = Clock()
    policy = make_policy(clock, peer_queue_until_report=on)
    for replica_id in REPLICAS:
        report(policy, replica_id, 1)
    decision = PeerDecision.of(routing(list(range(5000, 5000 + 4 * BLOCK + 3)), num_output_tokens=16),
                               REPLICAS[2], BLOCK)
    policy.on_peer_routed(decision.request, decision.replica_id, decision.tail_token_ids)
    queued = policy.loads.load(REPLICAS[2])
    if on:  # its prompt (nothing cached) and its expected output at the queue's price
        assert queued >= decision.request.num_prompt_tokens
    else:
        assert queued == 0.0
    assert all(policy.loads.load(r) == 0.0 for r in REPLICAS if r != REPLICAS[2])
    report(policy, REPLICAS[2], 2, queued=40)  # the replica's queue replaces the guess
    assert policy.loads.load(REPLICAS[2]) == 40.0
    policy.check_invariants()


@pytest.mark.parametrize("on", [True, False])
def test_a_peers_prefill_at_a_fifo_replica_outlives_a_report_that_prices_it_at_nothing(on):
    """``peer_queue_until_done``: the replica's report says two requests are
    there (the peer's long cold prompt, running, and one behind it) but
    prices the prompt in prefill at nothing. This router keeps counting the
    peer's request until a report's count says it left."""
    clock = Clock()
    policy = make_policy(clock, peer_queue_until_done=on)
    for replica_id in REPLICAS:
        report(policy, replica_id, 1)
    decision = PeerDecision.of(routing(list(range(7000, 7000 + 40 * BLOCK)), num_output_tokens=16), REPLICAS[1], BLOCK)
    policy.on_peer_routed(decision.request, decision.replica_id, decision.tail_token_ids)
    booked = policy.loads.load(REPLICAS[1])
    assert booked >= decision.request.num_prompt_tokens
    summary = dict(num_queued_tokens=8, num_running=1, num_waiting=1)  # a FIFO server, its prefill priced at 0
    policy.on_summary(CacheSummary(REPLICAS[1], 2, 0.0, BLOCK, frozenset(), 0, 10_000, **summary))
    assert policy.loads.load(REPLICAS[1]) == (booked if on else 8.0)
    assert policy.rank(routing(list(range(9000, 9000 + 2 * BLOCK))))[0] != REPLICAS[1] or not on
    policy.on_summary(CacheSummary(REPLICAS[1], 3, 0.0, BLOCK, frozenset(), 0, 10_000, num_queued_tokens=8,
                                   num_running=0, num_waiting=0))  # it left: the report alone again
    assert policy.loads.load(REPLICAS[1]) == 8.0
    policy.check_invariants()


@pytest.mark.parametrize("sees_peers", [True, False])
def test_a_report_prices_the_prefill_in_progress_while_other_routers_share_the_traffic(sees_peers):
    """``peer_prefill_from_reports``: once another router's decisions reach
    this one, a report's ``num_prefilling_tokens`` (what a running prefill
    has left: another router's long cold prompt, say) is that replica's
    work after the report; a lone router books its own requests until they
    complete and leaves the field alone (it would count them twice)."""
    loads = {}
    for prefilling in (0, 3000):
        clock = Clock()
        policy = make_policy(clock)
        for replica_id in REPLICAS:
            report(policy, replica_id, 1)
        if sees_peers:
            decision = PeerDecision.of(routing(list(range(7000, 7000 + 2 * BLOCK)), num_output_tokens=16),
                                       REPLICAS[0], BLOCK)
            policy.on_peer_routed(decision.request, decision.replica_id, decision.tail_token_ids)
        policy.on_summary(CacheSummary(REPLICAS[1], 2, 0.0, BLOCK, frozenset(), 0, 10_000, num_queued_tokens=8,
                                       num_running=1, num_prefilling_tokens=prefilling))
        loads[prefilling] = policy.loads.load(REPLICAS[1])
        policy.check_invariants()
    assert loads[3000] - loads[0] == (3000 if sees_peers else 0)

def test_peers_queued_work_shortens_the_waits_four_routers_cause():
    """Multi-turn chats, FIFO replicas, four routers sharing decisions 50 ms
    late, seeds 0-3: counting another router's decision as queued work until
    its replica reports cuts TTFT p99 (1.41 -> 1.24 s) at the same hit rate."""
    figures = {}
    for on in (False, True):
        runs = [replay_seed("multi-turn", seed, routers=4, peer_queue_until_report=on) for seed in range(4)]
        figures[on] = [sum(r[name] for r in runs) / len(runs) for name in ("ttft_p99_s", "hit_rate")]
    assert figures[True][0] < 0.92 * figures[False][0]
    assert figures[True][1] >= figures[False][1] - 0.0005


def replay_seed(workload, seed, routers, **policy_args):
    """One seeded replay as ``router.simulate`` runs it from its command line."""
    from router import simulate
    argv = ["--workload", workload, "--replicas", "8", "--budget-tokens", "16000", "--routers", str(routers),
            "--summary-period-s", "0.25", "--share-decisions-s", "0.05", "--seed", str(seed), "--policies",
            "ours", "--policy-args", json.dumps(policy_args), "--json", "unused.json"]
    workload, config, _ = simulate.build_run(simulate.build_parser().parse_args(argv))
    return simulate.simulate(workload, config, ["ours"], seeds=(seed,))["policies"]["ours"]


def test_a_peer_decision_is_no_completion_of_this_router_and_turns_the_balance_scale_off():
    """With four routers' worth of outputs the router reads K ~ 4 and scales
    its balance term by it (its own recent work is ~1/4 of the fleet's);
    once the others' decisions are booked here its recent work is the
    fleet's, and the balance term is the configured one again, while the
    router count still reads 4 (the Workers' busy counters stay in use)."""
    clock = Clock()
    policy = make_policy(clock)
    with_history(clock, policy, 4 * 32 * 16 // len(REPLICAS))
    request = routing(list(range(9000, 9000 + 2 * BLOCK)))
    assert policy._scoring(request, clock.now).balance == pytest.approx(  # noqa: SLF001
        4 * policy.config.balance_weight, rel=0.05)
    tokens = list(range(7000, 7000 + 2 * BLOCK))
    for _ in range(3):
        decision = PeerDecision.of(routing(tokens), REPLICAS[0], BLOCK)
        policy.on_peer_routed(decision.request, decision.replica_id, decision.tail_token_ids)
    assert policy._scoring(request, clock.now).balance == policy.config.balance_weight  # noqa: SLF001
    status = policy.routing_status()
    assert status["routers_seen"] == pytest.approx(4.0, rel=0.05)
    assert status["balance_busy_source"] == "replica_counters"
    assert policy._share.sees_peers(clock.now)  # noqa: SLF001
    assert not policy._share.sees_peers(clock.now + 1.01 * policy.config.load_window_s)  # noqa: SLF001


# ------------------------------------------------------------- the simulator
def test_shared_decisions_win_back_what_a_second_router_loses_on_back_to_back_chat_turns():
    """The live load test's chats (48 × 6, the next turn ~30 ms after the
    answer) over 2 CPU Workers: a second independent router loses hit rate
    (the second turn of a new chat reaches the router that has not seen the
    first); booking each other's decisions 50 ms late wins most of it back."""
    sessions = build_workload("multi-turn", "cpu", {"num_chats": 48, "num_turns": 6}, None, 0)
    workload = from_sessions(sessions, 64, "multi-turn", 0)
    profile = StepProfile.load("router/profiles/tiny_llama_cpu.json")
    hits = {}
    for routers, share_s in ((1, None), (2, None), (2, 0.05)):
        config = SimConfig(num_replicas=2, budget_tokens=65536, replica_model="cb", profile=profile,
                           policy=PolicyConfig(block_size=64, replicate_hot_prefixes=False),
                           closed_loop=ClosedLoopConfig(8, ingress_s=0.03), num_routers=routers,
                           summary_period_s=0.25, share_decisions_s=share_s)
        hits[routers, share_s] = replay(workload, config, "ours")["hit_rate"]
    assert hits[2, None] < hits[1, None] - 0.015  # 0.882 against 0.909
    assert hits[2, 0.05] > hits[2, None] + 0.01  # 0.900
    with pytest.raises(ValueError):
        SimConfig(num_replicas=2, budget_tokens=100, share_decisions_s=-1.0)
