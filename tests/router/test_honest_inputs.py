"""The simulated router sees only what a live router sees: RoutingRequests
(max_tokens, never the output length), the CacheSummaries a worker fills, and
completion events."""

from dataclasses import fields

import pytest

import router.simulate as simulate
from cache.summary import CacheSummary
from router.batching import BatchingReplica, StepProfile
from router.cluster import CostModel, SimReplica
from router.fetch import FetchHint, RoutingDecision
from router.request import RoutingRequest
from router.simulate import SimConfig, replay
from router.workload import SimRequest, Workload, shared_prefix


class SpyPolicy:
    """Stands in for PrefixAffinityPolicy and records every call and argument type."""

    calls: list = []

    def __init__(self, config, clock):
        self._clock, self._replicas = clock, []

    def set_replicas(self, ids):
        self._replicas = sorted(ids)
        SpyPolicy.calls.append(("set_replicas", tuple(self._replicas)))

    def rank(self, request, *args, **kwargs):
        SpyPolicy.calls.append(("rank", request))
        return self._replicas

    def decide(self, request, candidate_ids=None, request_id=None):
        """Ranks as rank() and hints a fetch from the second replica (the fetch path)."""
        SpyPolicy.calls.append(("decide", request, request_id))
        hint = FetchHint(self._replicas[1], 64) if request.num_prompt_tokens > 64 else None
        return RoutingDecision(tuple(self._replicas), hint)

    def on_routed(self, request, replica_id, request_id):
        SpyPolicy.calls.append(("on_routed", request, replica_id, request_id))

    def on_completed(self, request_id):
        SpyPolicy.calls.append(("on_completed", request_id, self._clock()))

    def on_summary(self, summary):
        SpyPolicy.calls.append(("on_summary", summary))


def workload_with_short_outputs():
    base = shared_prefix(num_groups=2, prompts_per_group=5, system_tokens=128, question_tokens=16, output_tokens=8)
    requests = tuple(SimRequest(r.arrival_s, r.units, r.unit_tokens, r.num_prompt_tokens, 1 + i % 5,
                                r.block_hashes, r.cache_units) for i, r in enumerate(base.requests))
    return Workload(requests, base.unit_tokens, base.router_block_tokens, base.name)


@pytest.mark.parametrize("replica_model", ["fifo", "cb"])
def test_the_policy_gets_only_routing_requests_summaries_and_completions(monkeypatch, replica_model):
    monkeypatch.setattr(simulate, "PrefixAffinityPolicy", SpyPolicy)
    SpyPolicy.calls = []
    workload = workload_with_short_outputs()
    config = SimConfig(num_replicas=2, budget_tokens=10_000, max_tokens=512, replica_model=replica_model,
                       summary_period_s=0.05)
    replay(workload, config, "ours")
    kinds = {call[0] for call in SpyPolicy.calls}
    assert kinds == {"set_replicas", "decide", "on_routed", "on_completed", "on_summary"}
    for call in SpyPolicy.calls:
        if call[0] in ("decide", "on_routed"):
            assert type(call[1]) is RoutingRequest
            assert call[1].num_output_tokens == 512  # max_tokens, though outputs are 1..5
        if call[0] == "on_summary":
            assert type(call[1]) is CacheSummary
    completions = [c for c in SpyPolicy.calls if c[0] == "on_completed"]
    assert len(completions) == len(workload.requests)
    routed = [c[3] for c in SpyPolicy.calls if c[0] == "on_routed"]
    assert sorted(c[1] for c in completions) == sorted(routed)
    reported = [c[1] for c in SpyPolicy.calls if c[0] == "on_summary"]
    assert any(s.mean_output_tokens > 0 for s in reported)
    assert all(s.mean_output_tokens <= 5 for s in reported)  # learned from finished requests only


@pytest.mark.parametrize("replica_model", ["fifo", "cb"])
def test_a_fetch_hint_reaches_the_chosen_replica_and_the_policy_still_sees_only_its_inputs(monkeypatch, replica_model):
    """The fetch path adds nothing to what the policy reads: the hint it
    returned goes to the replica it chose (which reads the owner's cache,
    as a live worker asks its owner), never back into the policy."""
    monkeypatch.setattr(simulate, "PrefixAffinityPolicy", SpyPolicy)
    SpyPolicy.calls = []
    workload = workload_with_short_outputs()
    config = SimConfig(num_replicas=2, budget_tokens=10_000, max_tokens=512, replica_model=replica_model,
                       summary_period_s=0.05)
    figures = replay(workload, config, "ours")
    num_hints = sum(1 for c in SpyPolicy.calls if c[0] == "decide" and c[1].num_prompt_tokens > 64)
    assert num_hints == len(workload.requests) == figures["num_fetch_hints"]
    planned = (figures["num_fetches"] + figures["num_fetch_held"] + figures["num_fetch_evicted"]
               + figures["num_fetch_slower"])
    assert planned == num_hints  # every hint planned once, by the chosen replica-0
    assert {c[0] for c in SpyPolicy.calls} == {"set_replicas", "decide", "on_routed", "on_completed", "on_summary"}
    assert all(type(c[1]) is RoutingRequest for c in SpyPolicy.calls if c[0] in ("decide", "on_routed"))


def test_generated_workloads_send_their_fixed_output_length_as_max_tokens():
    workload = shared_prefix(num_groups=2, prompts_per_group=2, system_tokens=64, question_tokens=8, output_tokens=8)
    ours = simulate.Ours(workload, [SimReplica("replica-0", 100, CostModel())], SimConfig(1, 100))
    assert ours.routing_request(workload.requests[0]).num_output_tokens == 8


def request(arrival_s, num_prompt, num_output, base=0):
    units = tuple(range(base, base + num_prompt))
    return SimRequest(arrival_s, units, 1, num_prompt, num_output, (), units)


def test_a_fifo_summary_is_what_the_worker_observes():
    replica = SimReplica("r", 10_000, CostModel(prefill_tokens_per_s=100.0, decode_s_per_token=0.5))
    replica.submit(0, request(0.0, 100, 4), 0.0)  # prefill 0..1 s, decode until 3 s
    replica.submit(1, request(0.0, 50, 2, base=1000), 0.0)  # waits until 3 s
    replica.advance(0.25)
    in_prefill = replica.summary(1, 0.25, 1, 4)  # request 0 has 75 of its 100 prompt tokens left to prefill
    assert (in_prefill.num_queued_tokens, in_prefill.num_prefilling_tokens) == (50, 75)
    replica.advance(1.6)
    summary = replica.summary(1, 1.6, 1, 4)
    # running: 100 prompt tokens + 2 output tokens so far (first at 1.0 s, second by 1.5 s)
    assert (summary.num_running, summary.num_waiting) == (1, 1)
    assert (summary.num_running_tokens, summary.num_queued_tokens, summary.num_prefilling_tokens) == (102, 50, 0)
    assert summary.mean_output_tokens == 0.0  # nothing finished yet
    replica.advance(3.0)
    later = replica.summary(2, 3.0, 1, 4)
    assert later.mean_output_tokens == 4.0
    assert summary.output_quantiles == () and later.output_quantiles == (4,) * 16  # the finished outputs' tail
    assert (later.num_prefill_tokens_total, later.num_output_tokens_total) == (150, 4)
    # busy: 1.0 + 2.0 s of request 0 and 0.5 + 1.0 s of request 1 by 4.5 s; at 1.6 s only 1.6 of them
    assert summary.busy_s_total == pytest.approx(1.6)
    assert later.busy_s_total == pytest.approx(3.0)
    assert replica.summary(3, 10.0, 1, 4).busy_s_total == pytest.approx(4.5) == replica.busy_s
    # what its steps cost, as a worker measures it: one price under FIFO (0.5 s / 0.01 s a token)
    assert (later.decode_token_cost, later.queue_token_cost) == (50.0, 50.0)
    contract = ["replica_id", "version", "timestamp_s", "block_size", "block_hashes", "num_cached_tokens",
                "budget_tokens", "num_queued_tokens", "num_running_tokens", "num_running", "num_waiting",
                "mean_output_tokens"]  # DESIGN.md's order; extensions follow
    assert [f.name for f in fields(CacheSummary)][: len(contract)] == contract


def test_a_batching_summary_counts_prompts_not_yet_admitted_and_running_tokens():
    profile = StepProfile(0.01, 0.001, 0.0, 0.0, max_batch_tokens=64, kv_capacity_tokens=10_000)
    replica = BatchingReplica("r", 10_000, profile)
    replica.submit(0, request(0.0, 100, 3), 0.0)
    replica.submit(1, request(0.0, 40, 3, base=1000), 0.0)
    replica.advance(0.01)  # one step: 64 prefill tokens of request 0; request 1 not admitted
    summary = replica.summary(1, 0.01, 1, 4)
    assert (summary.num_running, summary.num_waiting) == (1, 1)
    assert (summary.num_running_tokens, summary.num_queued_tokens) == (100, 40)
    assert summary.num_prefilling_tokens == 100 - 64  # request 0's prompt not yet prefilled
    # a lone decode step (10 ms) against a prefill token (1 ms): busy 10; a decoding row costs 0 here
    assert (summary.decode_token_cost, summary.queue_token_cost) == (10.0, 0.0)
    assert 0.0 < summary.busy_s_total <= 0.01 + 1e-12  # the steps up to now, not the one that runs past it
    busy = [replica.summary(2 + i, now, 1, 4).busy_s_total for i, now in enumerate((0.02, 0.05, 0.5, 5.0))
            if replica.advance(now) is not None]
    assert busy == sorted(busy) and busy[-1] == pytest.approx(replica.busy_s)  # a counter; all of it once idle


def test_a_simulated_busy_counter_never_goes_back():
    """Every summary's ``busy_s_total`` is at least the replica's previous
    one, as a live counter is. Shared-prefix seed 16 under continuous
    batching with four routers: replica-2's counter, a difference of floats,
    read 1e-15 s lower at 5.75 s than at 5.5 s, and the routers read that as
    a restart (their four-router imbalance was 1.25 on that seed, 1.08
    without it)."""
    argv = ["--workload", "shared-prefix", "--replicas", "8", "--budget-tokens", "8000", "--replica-model", "cb",
            "--routers", "4", "--summary-period-s", "0.25", "--share-decisions-s", "0.05", "--seed", "16",
            "--policies", "ours", "--json", "unused.json"]
    workload, config, _ = simulate.build_run(simulate.build_parser().parse_args(argv))
    counters: dict[str, list[float]] = {}
    real_on_summary = simulate.Ours.on_summary

    def record(self, summary, now):
        counters.setdefault(summary.replica_id, []).append(summary.busy_s_total)
        real_on_summary(self, summary, now)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulate.Ours, "on_summary", record)
        replay(simulate.scale_arrivals(workload, simulate.arrival_scale(workload, config)), config, "ours")
    assert len(counters) == 8 and all(len(c) > 20 for c in counters.values())
    for replica_id, counts in counters.items():
        assert all(b >= a for a, b in zip(counts, counts[1:])), replica_id


def test_a_simulated_router_given_the_fifo_price_learns_the_batching_profiles_two():
    """As live: the policy's configured prices are priors; the replicas'
    summaries carry their step profile's prices and those come into force."""
    profile = StepProfile(0.002, 1e-5, 5e-5, 0.0, max_batch_tokens=512, kv_capacity_tokens=100_000)
    workload = shared_prefix(num_groups=2, prompts_per_group=8, system_tokens=128, question_tokens=16,
                             output_tokens=8)
    seen = []
    real_init = simulate.PrefixAffinityPolicy.__init__

    def keep(self, config, clock):
        real_init(self, config, clock)
        seen.append(self)

    config = SimConfig(num_replicas=2, budget_tokens=10_000, replica_model="cb", profile=profile,
                       decode_token_cost=40.0,
                       policy=simulate.PolicyConfig(queue_decode_token_cost=40.0, block_size=16))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulate.PrefixAffinityPolicy, "__init__", keep)
        replay(workload, config, "ours")
    (policy,) = seen
    assert policy.config.decode_token_cost == pytest.approx(profile.decode_token_cost)  # (2 ms + 50 µs) / 10 µs
    assert policy.config.queue_token_cost == pytest.approx(profile.queue_token_cost)  # 50 µs / 10 µs
    assert (round(profile.decode_token_cost), round(profile.queue_token_cost)) == (205, 5)


@pytest.mark.parametrize("replica_model", ["fifo", "cb"])
def test_replicas_given_reported_prices_report_them_and_keep_their_timing(replica_model):
    config = SimConfig(num_replicas=2, budget_tokens=1000, replica_model=replica_model,
                       reported_token_costs=(50.0, 2.0))
    replicas = simulate.make_replicas(config, 1000)
    assert [r.summary(1, 0.0, 1, 4).decode_token_cost for r in replicas] == [50.0, 50.0]
    assert replicas[0].summary(1, 0.0, 1, 4).queue_token_cost == 2.0
    timing = config.timing  # what the replica's steps cost is unchanged
    assert timing.decode_token_cost != 50.0
    plain = simulate.make_replicas(SimConfig(num_replicas=1, budget_tokens=1000, replica_model=replica_model), 1000)
    assert plain[0].summary(1, 0.0, 1, 4).decode_token_cost == pytest.approx(timing.decode_token_cost)
