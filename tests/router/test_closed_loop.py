"""router.closed_loop: the simulator's closed-loop arrivals, as the live load test sends requests."""

import random
from dataclasses import dataclass, replace

import pytest

from harness.workloads import build_workload
from router.batching import StepProfile
from router.closed_loop import ClosedLoop, ClosedLoopConfig, arrivals
from router.simulate import SimConfig, replay
from router.workload import from_sessions, multi_turn, shared_prefix

PROFILE = StepProfile(0.002, 10e-6, 50e-6, 0.0, 512, 65536, name="test")


@dataclass(frozen=True)
class Done:
    number: int
    finish_s: float


class FixedTimeCluster:
    """Every request takes ``service_s`` from its send, however many run: a fake for the loop alone."""

    def __init__(self, service_s: float) -> None:
        self.service_s = service_s
        self.pending: list[Done] = []
        self.max_in_flight = 0

    def send(self, number: int, now: float) -> None:
        self.pending.append(Done(number, now + self.service_s))
        self.max_in_flight = max(self.max_in_flight, len(self.pending))

    def catch_up(self, now: float) -> list[Done]:
        done = [d for d in self.pending if d.finish_s <= now]
        self.pending = [d for d in self.pending if d.finish_s > now]
        return done


def drive(loop: ClosedLoop, cluster: FixedTimeCluster, tick_s: float = 0.001) -> list[tuple[int, float]]:
    sent = []
    for number, now in arrivals(loop, cluster.catch_up, tick_s):
        loop.check_invariants()
        cluster.send(number, now)
        sent.append((number, now))
    return sent


def test_a_session_sends_its_next_turn_only_after_the_last_completes_plus_the_gap():
    loop = ClosedLoop([(0, 1, 2), (3,)], concurrency=1, ingress_s=0.010)
    sent = drive(loop, FixedTimeCluster(0.100))
    assert [n for n, _ in sent] == [0, 1, 2, 3]  # one worker: the session's turns in order, then the next session
    times = [t for _, t in sent]
    for earlier, later in zip(times, times[1:]):
        assert 0.110 <= later - earlier < 0.110 + 0.001 + 1e-9  # completion + gap, late by under one tick
    assert loop.done and loop.num_sent == 4


def test_with_live_ingress_samples_each_send_draws_its_trip_the_first_burst_included():
    """The workers' first requests reach the engine spread by their own
    trips, not at one instant; each later turn follows its predecessor's
    completion by a drawn trip; the same seed draws the same."""
    samples = (0.012, 0.030, 0.045, 0.090)
    config = ClosedLoopConfig(4, ingress_samples_s=samples, seed=3)
    sent = drive(config.loop([(0, 1), (2, 3), (4, 5), (6, 7)]), FixedTimeCluster(0.100))
    first = sorted(t for n, t in sent if n % 2 == 0)
    assert len(set(first)) > 1 and all(any(abs(t - x) < 0.0011 for x in samples) for t in first)
    finish = {n: t + 0.100 for n, t in sent}
    for n, t in sent:
        if n % 2:  # a second turn: its first's completion plus one of the samples, late by under a tick
            assert any(0 <= t - finish[n - 1] - x < 0.0011 for x in samples)
    again = drive(ClosedLoopConfig(4, ingress_samples_s=samples, seed=3).loop([(0, 1), (2, 3), (4, 5), (6, 7)]),
                  FixedTimeCluster(0.100))
    assert again == sent
    with pytest.raises(ValueError, match="ingress_samples_s"):
        ClosedLoopConfig(4, ingress_samples_s=(0.01, -1.0))


def test_never_more_in_flight_than_client_workers_and_every_request_sent_once():
    rng = random.Random(3)
    sessions, number = [], 0
    for _ in range(30):
        turns = rng.randint(1, 5)
        sessions.append(tuple(range(number, number + turns)))
        number += turns
    cluster = FixedTimeCluster(0.037)
    sent = drive(ClosedLoop(sessions, concurrency=4), cluster)
    assert sorted(n for n, _ in sent) == list(range(number))
    assert cluster.max_in_flight == 4
    first_sends = [t for n, t in sent if n in {s[0] for s in sessions[:4]}]
    assert first_sends == [0.0] * 4  # the first `concurrency` sessions start together


def test_idle_time_is_skipped_to_the_next_send():
    loop = ClosedLoop([(0, 1)], concurrency=1, think_s=5.0)
    sent = drive(loop, FixedTimeCluster(0.010), tick_s=0.001)
    assert sent[1][1] == pytest.approx(5.010, abs=0.0011)


@pytest.mark.parametrize("kwargs, message", [
    (dict(concurrency=0), "concurrency"),
    (dict(concurrency=2, think_s=-1.0), "think_s"),
    (dict(concurrency=2, ingress_s=float("nan")), "ingress_s"),
])
def test_bad_settings_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClosedLoop([(0,)], **kwargs)
    with pytest.raises(ValueError, match=message):
        ClosedLoopConfig(**kwargs)


def test_a_request_in_two_sessions_and_an_unknown_completion_are_value_errors():
    with pytest.raises(ValueError, match="more than one"):
        ClosedLoop([(0, 1), (1,)], concurrency=2)
    loop = ClosedLoop([(0,)], concurrency=1)
    with pytest.raises(ValueError, match="not in flight"):
        loop.on_completed(7, 1.0)


def closed_config(concurrency: int, replicas: int = 1) -> SimConfig:
    return SimConfig(num_replicas=replicas, budget_tokens=65536, replica_model="cb", profile=PROFILE,
                     closed_loop=ClosedLoopConfig(concurrency, tick_s=0.0002))


def test_one_client_never_queues_while_the_open_loop_at_high_load_does():
    workload = from_sessions(build_workload("shared-prefix", "cpu", {"num_groups": 2, "prompts_per_group": 6}, None, 0),
                             64, "shared-prefix")
    alone = replay(workload, closed_config(concurrency=1), "ours")
    assert alone["wait_p99_s"] < 0.0002 + 1e-9  # each request alone on the replica: TTFT = its own prefill
    assert alone["own_prefill_p99_s"] == pytest.approx(alone["ttft_p99_s"], abs=0.0002 + 1e-9)
    crowded = replay(workload, closed_config(concurrency=8), "ours")
    assert crowded["ttft_p50_s"] > alone["ttft_p50_s"]
    assert crowded["own_prefill_p99_s"] < crowded["ttft_p99_s"]  # the queue's share of the tail
    assert crowded["hit_rate"] == pytest.approx(alone["hit_rate"], abs=0.05)


def test_closed_loop_turns_of_a_chat_hit_their_history():
    sessions = build_workload("multi-turn", "cpu", {"num_chats": 4, "num_turns": 3}, None, 0)
    workload = from_sessions(sessions, 64, "multi-turn")
    assert workload.sessions == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11))
    first, second = workload.requests[0], workload.requests[1]
    assert second.units[: len(first.cache_units)] == first.cache_units  # the history, answer but its last token
    assert len(first.cache_units) == first.num_prompt_tokens + first.num_output_tokens - 1
    figures = replay(workload, closed_config(concurrency=2, replicas=2), "ours")
    # a later turn, sent only after the previous one finished, reuses that turn's cached history
    prompt = sum(r.num_prompt_tokens for r in workload.requests)
    history = sum(len(workload.requests[n - 1].cache_units) for n in range(len(workload.requests)) if n % 3)
    assert figures["hit_rate"] >= history / prompt


def test_simulate_cli_offers_closed_arrivals(tmp_path):
    from router.simulate import main

    out = tmp_path / "closed.json"
    args = ["--workload", "multi-turn", "--replicas", "2", "--budget-tokens", "20000", "--json", str(out),
            "--replica-model", "cb", "--arrivals", "closed", "--concurrency", "3", "--ingress-s", "0.01",
            "--policies", "ours,pow2", "--no-progress",
            "--workload-args", '{"num_conversations": 6, "num_turns": 2, "output_tokens": 8}']
    assert main(args) == 0
    import json
    result = json.loads(out.read_text())
    assert result["setup"]["closed_loop"]["concurrency"] == 3
    assert result["setup"]["arrival_scale"] == 1.0
    assert set(result["policies"]) == {"ours", "pow2"}


def test_a_generated_workload_without_sessions_sends_each_request_as_its_own_session():
    workload = shared_prefix(num_groups=2, prompts_per_group=3, system_tokens=64, question_tokens=16, output_tokens=4)
    assert workload.sessions == ()
    figures = replay(workload, closed_config(concurrency=2, replicas=2), "pow2")
    assert figures["ttft_p50_s"] > 0


def test_the_generated_multi_turn_workload_sends_a_chats_turn_once_the_last_one_is_answered():
    """Its sessions are its chats (turns in order), so the closed loop is
    causal: no turn leaves before the chat's previous answer exists."""
    workload = multi_turn(num_conversations=5, num_turns=3, system_tokens=64, question_tokens=16, output_tokens=4)
    assert sorted(n for session in workload.sessions for n in session) == list(range(15))
    for session in workload.sessions:
        assert len(session) == 3
        for earlier, later in zip(session, session[1:]):
            history = workload.requests[earlier].cache_units
            assert workload.requests[later].units[: len(history)] == history  # the next turn of the same chat
    assert [s[0] for s in workload.sessions] == sorted(s[0] for s in workload.sessions)
    figures = replay(workload, closed_config(concurrency=5, replicas=2), "ours")
    prompt = sum(r.num_prompt_tokens for r in workload.requests)
    history = sum(len(workload.requests[earlier].cache_units)
                  for session in workload.sessions for earlier in session[:-1])
    assert figures["hit_rate"] >= history / prompt  # every later turn found its chat's answered history


def test_a_closed_loop_replay_reports_the_one_cache_bound_over_its_own_order():
    """Closed-loop sends depend on each policy's completions, so the bound
    over the workload's generated order is not one its requests met: each
    policy's figures carry the one-cache bounds over the order it was sent."""
    from router.simulate import bounds_as_sent, cache_bound_hit_rate

    workload = multi_turn(num_conversations=6, num_turns=3, system_tokens=64, question_tokens=16, output_tokens=4)
    config = closed_config(concurrency=2, replicas=2)
    figures = replay(workload, config, "round_robin")
    assert 0 < figures["global_lru_hit_rate_as_sent"] <= 1
    # with two clients, the first two chats run to their end before the third starts: not the generated order
    order = [n for s in workload.sessions for n in s]
    tight = replace(config, budget_tokens=150)  # a cache too small for two chats' histories: order matters
    as_sessions = bounds_as_sent(workload, tight, order)["global_lru_hit_rate_as_sent"]
    as_generated = cache_bound_hit_rate(workload, tight.budget_tokens * tight.num_replicas)
    assert as_sessions != as_generated
    assert figures["global_cache_hit_rate_as_sent"] == figures["global_lru_hit_rate_as_sent"]  # room to spare
    open_loop = replay(workload, replace(config, closed_loop=None), "round_robin")
    assert "global_lru_hit_rate_as_sent" not in open_loop  # open loop: the workload's order is the order sent


def test_prompt_imbalance_counts_prompt_tokens_per_replica_as_the_load_test_does():
    workload = from_sessions(build_workload("shared-prefix", "cpu", {"num_groups": 2, "prompts_per_group": 6}, None, 0),
                             64, "shared-prefix")
    figures = replay(workload, closed_config(concurrency=4, replicas=2), "round_robin")
    assert figures["prompt_imbalance"] == pytest.approx(1.0)  # 12 equal prompts, alternately: 6 and 6
    one = replay(workload, closed_config(concurrency=4, replicas=1), "ours")
    assert one["prompt_imbalance"] == 1.0
