"""The simulator's KV fetch (router/sim_fetch.py) in both replica models."""

import math

import pytest

from router.batching import BatchingReplica, StepProfile
from router.cluster import CostModel, SimReplica
from router.sim_fetch import LLAMA_8B_KV_BYTES_PER_TOKEN, FetchModel, SimFetch, hinted_units, plan_fetch
from router.simulate import POLICY_NAMES, SimConfig, replay
from router.workload import SimRequest, shared_prefix

PREFILL_TOKENS_PER_S = 1000.0
PREFIX = tuple(range(400))
FAST = FetchModel(kv_bytes_per_token=1000, bandwidth_bytes_per_s=1e7, latency_s=0.001, export_fraction=0.1)
FAST_TRANSFER_S = 0.001 + 400 * 1000 / 1e7  # 0.041 s against 0.4 s of recompute


def make_replica(model, replica_id, budget_units=10_000):
    if model == "fifo":
        return SimReplica(replica_id, budget_units, CostModel(PREFILL_TOKENS_PER_S, 0.001))
    profile = StepProfile(base_s=0.0, prefill_token_s=1 / PREFILL_TOKENS_PER_S, decode_seq_s=0.0,
                          context_token_s=0.0, max_batch_tokens=4096, kv_capacity_tokens=100_000)
    return BatchingReplica(replica_id, budget_units, profile)


def request(arrival_s, units, num_output=1):
    units = tuple(units)
    return SimRequest(arrival_s, units, 1, len(units), num_output, (), units)


def warm_owner(model, budget_units=10_000):
    owner = make_replica(model, "owner", budget_units)
    owner.submit(0, request(0.0, PREFIX + tuple(range(5000, 5010))), 0.0)
    owner.advance(math.inf)
    assert owner.match_units(PREFIX) == len(PREFIX)
    return owner


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_fetched_tokens_count_as_saved_prefill(model):
    owner = warm_owner(model)
    receiver = make_replica(model, "receiver")
    busy_before = owner.busy_s
    receiver.submit(1, request(10.0, PREFIX + tuple(range(9000, 9010))), 10.0, SimFetch(owner, 400, FAST))
    receiver.advance(math.inf)
    outcome = receiver.outcomes[1]
    assert (outcome.cached_tokens, outcome.fetched_tokens) == (400, 400)
    assert outcome.ttft_s == pytest.approx(FAST_TRANSFER_S + 10 / PREFILL_TOKENS_PER_S)  # transfer, then 10 tokens
    counts = receiver.fetch_counts
    assert (counts.num_fetched, counts.num_fetched_tokens, counts.num_evicted, counts.num_slower) == (1, 400, 0, 0)
    assert owner.busy_s - busy_before == pytest.approx(0.1 * FAST_TRANSFER_S)
    assert owner.fetch_counts.export_busy_s == pytest.approx(0.1 * FAST_TRANSFER_S)
    assert receiver.match_units(PREFIX) == 400  # it holds the prefix now, for later requests
    summary = receiver.summary(1, 20.0, 1, 4)
    assert summary.num_prefill_tokens_total == 10  # only what it computed


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_an_owner_that_evicted_the_prefix_means_recompute(model):
    owner = warm_owner(model, budget_units=420)
    owner.submit(1, request(1.0, range(20_000, 20_420)), 1.0)  # a 420-token prompt pushes the prefix out
    owner.advance(math.inf)
    assert owner.match_units(PREFIX) == 0
    receiver = make_replica(model, "receiver")
    receiver.submit(2, request(10.0, PREFIX + tuple(range(9000, 9010))), 10.0, SimFetch(owner, 400, FAST))
    receiver.advance(math.inf)
    outcome = receiver.outcomes[2]
    assert (outcome.cached_tokens, outcome.fetched_tokens) == (0, 0)
    assert outcome.ttft_s == pytest.approx(FAST.latency_s + 410 / PREFILL_TOKENS_PER_S)  # the ask, then recompute
    assert (receiver.fetch_counts.num_evicted, receiver.fetch_counts.num_fetched) == (1, 0)
    assert owner.fetch_counts.export_busy_s == 0.0


def run_together(replicas, until_s, tick_s=0.01):
    """Advance the replicas side by side, as the replay does between events."""
    for step in range(1, round(until_s / tick_s) + 1):
        for replica in replicas:
            replica.advance(step * tick_s)
    for replica in replicas:
        replica.advance(math.inf)


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_a_prefix_the_owner_still_computes_comes_once_computed(model):
    """The owner's cache takes a prompt's blocks as its prefill computes
    them (the worker inserts each chunk's full blocks once it ran); an
    export reads no more, but the live owner waits for its prefill in
    flight up to the receiver's patience (``ExportRequest.wait_s``). A hint
    that arrives while the owner's prefill of the prefix is under way waits
    for it (0.21 s), then fetches: sooner than recomputing (0.41 s)."""
    owner = make_replica(model, "owner")
    owner.submit(0, request(0.0, PREFIX + tuple(range(5000, 5010))), 0.0)  # 410 tokens: 0.41 s of prefill
    owner.advance(0.2)
    assert owner.match_units(PREFIX) == len(PREFIX)  # in its tree since arrival (admission)
    assert owner.computed_units(PREFIX, 0.2) < 300  # but at most its first ~200 tokens computed
    receiver = make_replica(model, "receiver")
    receiver.submit(1, request(0.2, PREFIX + tuple(range(9000, 9010))), 0.2, SimFetch(owner, 400, FAST))
    run_together([owner, receiver], 1.0)
    outcome, counts = receiver.outcomes[1], receiver.fetch_counts
    assert outcome.fetched_tokens == 400
    waited_s = 0.41 - 0.2
    expected_s = waited_s + FAST_TRANSFER_S + 10 / PREFILL_TOKENS_PER_S
    if model == "fifo":  # the FIFO model knows when the prefill ends
        assert outcome.ttft_s == pytest.approx(expected_s)
    else:  # the batching receiver looks again every OWNER_POLL_S
        assert expected_s - 1e-9 <= outcome.ttft_s <= expected_s + 0.011
    assert (counts.num_fetched, counts.num_waited, counts.num_outwaited) == (1, 1, 0)


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_an_owner_prefill_that_ends_too_late_is_outwaited(model):
    """The owner computes the prefix behind 2,000 other tokens (done at
    2.41 s). The receiver waits its patience (its recompute time, 0.4 s,
    less the transfer for the batching model, which cannot know the end
    ahead), then recomputes."""
    owner = make_replica(model, "owner")
    owner.submit(0, request(0.0, range(30_000, 32_000)), 0.0)
    owner.submit(1, request(0.0, PREFIX + tuple(range(5000, 5010))), 0.0)
    receiver = make_replica(model, "receiver")
    receiver.submit(2, request(0.2, PREFIX + tuple(range(9000, 9010))), 0.2, SimFetch(owner, 400, FAST))
    run_together([owner, receiver], 3.0)
    outcome, counts = receiver.outcomes[2], receiver.fetch_counts
    assert outcome.fetched_tokens == 0
    assert (counts.num_fetched, counts.num_outwaited) == (0, 1)
    recompute_s = 410 / PREFILL_TOKENS_PER_S
    if model == "fifo":
        assert outcome.ttft_s == pytest.approx(400 / PREFILL_TOKENS_PER_S + recompute_s)
    else:
        patience_s = 400 / PREFILL_TOKENS_PER_S - FAST_TRANSFER_S
        assert patience_s + recompute_s - 1e-9 <= outcome.ttft_s <= patience_s + recompute_s + 0.011
    if model == "cb":
        receiver.check_invariants()


@pytest.mark.parametrize("model", ["fifo", "cb"])
@pytest.mark.parametrize("owner_computing", [False, True])
def test_a_hint_that_says_the_owner_computes_waits_its_prefill_patience(model, owner_computing):
    """The owner computes the prefix behind 400 other tokens (done at 0.81
    s). A receiver at 0.2 s would recompute it in 0.4 s: with patience 1 it
    stops waiting first; told by the hint that the owner computes it, it
    waits up to 3 x (``FetchModel.prefill_patience``) and fetches."""
    owner = make_replica(model, "owner")
    owner.submit(0, request(0.0, range(30_000, 30_400)), 0.0)
    owner.submit(1, request(0.0, PREFIX + tuple(range(5000, 5010))), 0.0)
    receiver = make_replica(model, "receiver")
    fetch = SimFetch(owner, 400, FAST, owner_computing=owner_computing)
    receiver.submit(2, request(0.2, PREFIX + tuple(range(9000, 9010))), 0.2, fetch)
    run_together([owner, receiver], 2.0)
    assert receiver.outcomes[2].fetched_tokens == (400 if owner_computing else 0)
    assert receiver.fetch_counts.num_outwaited == (0 if owner_computing else 1)


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_a_prefix_the_owner_has_not_admitted_yet_is_waited_for_then_fetched(model):
    """Both prompts arrive at the same instant, the owner's not yet in its
    tree (the batching model admits at its next step; the live engine's
    inbox and waiting queue). The receiver, hinted, must count the owner's
    waiting prompt as a prefill in flight, as the live owner does
    (``Scheduler.in_flight_prefix_tokens``), wait for it and fetch, rather
    than find nothing and compute the prefix a second time."""
    owner = make_replica(model, "owner")
    owner.submit(0, request(0.0, PREFIX + tuple(range(5000, 5010))), 0.0)
    assert owner.queued_units(PREFIX) == (len(PREFIX) if model == "cb" else 0)  # FIFO: in its tree on arrival
    receiver = make_replica(model, "receiver")
    fetch = SimFetch(owner, 400, FAST, owner_computing=True)
    receiver.submit(1, request(0.0, PREFIX + tuple(range(9000, 9010))), 0.0, fetch)
    receiver.advance(0.0)  # the receiver's step comes first: the owner has admitted nothing
    run_together([receiver, owner], 2.0)
    assert receiver.outcomes[1].fetched_tokens == 400
    assert (receiver.fetch_counts.num_fetched, receiver.fetch_counts.num_outwaited) == (1, 0)
    if model == "cb":
        assert owner.queued_units(PREFIX) == 0  # admitted since
        receiver.check_invariants()


def test_a_queued_request_has_waited_for_the_owner_while_it_queued():
    """FIFO: the fetch starts at arrival; a request queued past the owner's
    prefill end stalls for the transfer only."""
    owner = make_replica("fifo", "owner")
    owner.submit(0, request(0.0, PREFIX + tuple(range(5000, 5010))), 0.0)  # computed by 0.41 s
    receiver = make_replica("fifo", "receiver")
    receiver.submit(1, request(0.2, range(40_000, 41_000)), 0.2)  # busy until 1.201 s
    receiver.submit(2, request(0.2, PREFIX + tuple(range(9000, 9010))), 0.2, SimFetch(owner, 400, FAST))
    outcome = receiver.outcomes[2]
    assert outcome.fetched_tokens == 400
    assert outcome.ttft_s == pytest.approx(1.001 + FAST_TRANSFER_S + 10 / PREFILL_TOKENS_PER_S)


def test_an_answer_not_yet_generated_is_not_fetched():
    """A FIFO replica caches a chat turn's prompt and answer at arrival;
    the answer's blocks exist once the turn finished."""
    owner = make_replica("fifo", "owner")
    prompt, answer = PREFIX, tuple(range(6000, 6100))
    owner.submit(0, SimRequest(0.0, prompt, 1, len(prompt), len(answer), (), prompt + answer), 0.0)
    # prefill 0.4 s, then 100 output tokens at 1 ms each: done at 0.5 s
    next_turn = prompt + answer + tuple(range(9000, 9010))
    assert owner.computed_units(next_turn, 0.45) == len(prompt)
    assert owner.computed_units(next_turn, 0.55) == len(prompt) + len(answer)


def evicted_owner(model, replica_id):
    owner = make_replica(model, replica_id, budget_units=420)
    owner.submit(0, request(0.0, PREFIX + tuple(range(5000, 5010))), 0.0)
    owner.submit(1, request(1.0, range(20_000, 20_420)), 1.0)  # a 420-token prompt pushes the prefix out
    owner.advance(math.inf)
    assert owner.match_units(PREFIX) == 0
    return owner


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_an_owner_that_evicted_the_prefix_hands_over_to_an_alternate_that_holds_it(model):
    """The hint's alternates are asked in turn, as the worker does: the
    first that holds more than the receiver exports it; every one before
    it cost a round trip (``latency_s``), and the fetch counts as from an
    alternate. When none holds it, the receiver recomputes after a round
    trip to each."""
    gone, holder = evicted_owner(model, "gone"), warm_owner(model)
    receiver = make_replica(model, "receiver")
    receiver.submit(2, request(10.0, PREFIX + tuple(range(9000, 9010))), 10.0,
                    SimFetch(gone, 400, FAST, (evicted_owner(model, "also-gone"), holder)))
    receiver.advance(math.inf)
    outcome = receiver.outcomes[2]
    assert (outcome.cached_tokens, outcome.fetched_tokens) == (400, 400)
    assert outcome.ttft_s == pytest.approx(2 * FAST.latency_s + FAST_TRANSFER_S + 10 / PREFILL_TOKENS_PER_S)
    counts = receiver.fetch_counts
    assert (counts.num_fetched, counts.num_from_alternate, counts.num_evicted) == (1, 1, 0)
    assert holder.fetch_counts.export_busy_s == pytest.approx(0.1 * FAST_TRANSFER_S)
    assert gone.fetch_counts.export_busy_s == 0.0

    plan = plan_fetch(SimFetch(holder, 400, FAST, (gone,)), PREFIX + (9,), 1, 0, lambda n: min(n, 400),
                      make_replica(model, "x").cost if model == "fifo" else make_replica(model, "x").profile, 20.0)
    assert (plan.reason, plan.num_asked, plan.from_alternate) == ("fetched", 1, False)  # the owner had it

    other = make_replica(model, "other")
    other.submit(3, request(10.0, PREFIX + tuple(range(9000, 9010))), 10.0,
                 SimFetch(gone, 400, FAST, (evicted_owner(model, "also-gone"),)))
    other.advance(math.inf)
    assert other.outcomes[3].ttft_s == pytest.approx(2 * FAST.latency_s + 410 / PREFILL_TOKENS_PER_S)
    assert (other.fetch_counts.num_evicted, other.fetch_counts.num_from_alternate) == (1, 0)


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_a_transfer_slower_than_recompute_means_recompute(model):
    owner = warm_owner(model)
    slow = FetchModel(kv_bytes_per_token=1000, bandwidth_bytes_per_s=1e6)  # 0.401 s > 0.4 s of prefill
    receiver = make_replica(model, "receiver")
    receiver.submit(1, request(10.0, PREFIX + tuple(range(9000, 9010))), 10.0, SimFetch(owner, 400, slow))
    receiver.advance(math.inf)
    assert receiver.outcomes[1].fetched_tokens == 0
    assert receiver.outcomes[1].ttft_s == pytest.approx(410 / PREFILL_TOKENS_PER_S)
    assert (receiver.fetch_counts.num_slower, receiver.fetch_counts.num_fetched) == (1, 0)
    assert owner.fetch_counts.export_busy_s == 0.0


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_the_export_keeps_the_owner_busy(model):
    owner = warm_owner(model)
    receiver = make_replica(model, "receiver")
    receiver.submit(1, request(10.0, PREFIX + (9000,)), 10.0, SimFetch(owner, 400, FAST))
    receiver.advance(10.000001)  # the fetch is planned when it starts (admission), at 10 s
    owner.submit(2, request(10.0, range(30_000, 30_010)), 10.0)  # a request of its own arrives meanwhile
    owner.advance(math.inf)
    export_s = 0.1 * FAST_TRANSFER_S
    assert owner.outcomes[2].ttft_s == pytest.approx(export_s + 10 / PREFILL_TOKENS_PER_S)


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_a_partly_held_prefix_fetches_what_the_receiver_lacks(model):
    owner = warm_owner(model)
    receiver = make_replica(model, "receiver")
    receiver.submit(1, request(0.0, PREFIX[:100] + (7777,)), 0.0)  # it holds the first 100 tokens
    receiver.advance(math.inf)
    receiver.submit(2, request(10.0, PREFIX + (8888,)), 10.0, SimFetch(owner, 400, FAST))
    receiver.advance(math.inf)
    outcome = receiver.outcomes[2]
    assert (outcome.cached_tokens, outcome.fetched_tokens) == (400, 300)
    assert outcome.ttft_s == pytest.approx(0.001 + 300 * 1000 / 1e7 + 1 / PREFILL_TOKENS_PER_S)


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_the_receiver_fetches_what_the_owner_holds_past_the_hint(model):
    # the owner cached PREFIX and its 10 answer tokens; the router knew only the 400 prompt tokens it routed
    owner = warm_owner(model)
    answer = tuple(range(5000, 5010))
    receiver = make_replica(model, "receiver")
    receiver.submit(1, request(10.0, PREFIX + answer + (42, 43)), 10.0, SimFetch(owner, 400, FAST))
    receiver.advance(math.inf)
    outcome = receiver.outcomes[1]
    assert (outcome.cached_tokens, outcome.fetched_tokens, outcome.held_elsewhere_tokens) == (410, 410, 0)
    assert receiver.match_units(PREFIX + answer) == 410


def test_a_fetch_waits_while_other_sequences_run_in_batching():
    owner = warm_owner("cb")
    receiver = make_replica("cb", "receiver")
    receiver.submit(1, request(10.0, PREFIX + (1,)), 10.0, SimFetch(owner, 400, FAST))
    receiver.submit(2, request(10.0, range(40_000, 40_020)), 10.0)
    receiver.advance(math.inf)
    assert receiver.outcomes[2].ttft_s == pytest.approx(20 / PREFILL_TOKENS_PER_S)  # not held up by the fetch
    assert receiver.outcomes[1].ttft_s >= FAST_TRANSFER_S
    receiver.check_invariants()


def trace_request(arrival_s, units, num_prompt_tokens):
    """A Mooncake-like request: 100-token units, the last one partial."""
    return SimRequest(arrival_s, tuple(units), 100, num_prompt_tokens, 1, (), tuple(units))


def trace_owner_and_receiver(model):
    """Both hold units 1 and 2; the owner also a partial unit 9 (60 tokens)."""
    owner, receiver = make_replica(model, "owner"), make_replica(model, "receiver")
    owner.submit(0, trace_request(0.0, (1, 2, 9), 260), 0.0)
    receiver.submit(0, trace_request(0.0, (1, 2, 8), 250), 0.0)
    for replica in (owner, receiver):
        replica.advance(math.inf)
    return owner, receiver


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_a_hint_into_a_partial_last_unit_fetches_that_unit(model):
    """A within-block hint names the full units and part of the partial last
    one (hash id 9, 60 tokens); the owner holds all of it, so the receiver,
    which holds the full units, fetches the rest of the prompt."""
    owner, receiver = trace_owner_and_receiver(model)
    receiver.submit(1, trace_request(10.0, (1, 2, 9), 260), 10.0, SimFetch(owner, 248, FAST))
    receiver.advance(math.inf)
    outcome = receiver.outcomes[1]
    assert (outcome.cached_tokens, outcome.fetched_tokens, outcome.held_elsewhere_tokens) == (259, 59, 0)
    assert hinted_units(248, 100) == 3 and hinted_units(200, 100) == 2 and hinted_units(7, 1) == 7


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_a_hint_of_full_units_alone_leaves_a_receiver_holding_them_as_it_was(model):
    owner, receiver = trace_owner_and_receiver(model)
    receiver.submit(1, trace_request(10.0, (1, 2, 9), 260), 10.0, SimFetch(owner, 200, FAST))
    receiver.advance(math.inf)
    assert receiver.fetch_counts.num_held == 1
    assert (receiver.outcomes[1].cached_tokens, receiver.outcomes[1].fetched_tokens) == (200, 0)  # its own units


def test_plan_fetch_never_hints_past_the_request():
    owner = warm_owner("fifo")
    req = request(0.0, PREFIX[:40])
    plan = plan_fetch(SimFetch(owner, 4096, FAST), req.units, 1, 0, req.cached_tokens,
                      CostModel(PREFILL_TOKENS_PER_S, 0.001), 0.0)
    assert plan.num_units == 40 and plan.num_tokens == 39  # the last prompt token is computed


def test_the_default_fetch_model_is_llama_8b_over_25_gb_per_s():
    model = FetchModel()
    assert model.kv_bytes_per_token == LLAMA_8B_KV_BYTES_PER_TOKEN == 131072
    assert model.transfer_s(4096) == pytest.approx(0.001 + 4096 * 131072 / 25e9)
    for bad in ({"kv_bytes_per_token": 0}, {"bandwidth_bytes_per_s": 0.0}, {"export_fraction": -0.1},
                {"latency_s": float("nan")}):
        with pytest.raises(ValueError):
            FetchModel(**bad)


def hot_group_workload():
    """Two groups, one far more popular: its home cannot take all of it."""
    base = shared_prefix(num_groups=2, prompts_per_group=48, system_tokens=1024, question_tokens=64,
                         output_tokens=16, rate_per_s=200.0, seed=1)
    return base


def hot_group_run(model):
    """:func:`hot_group_workload` at 0.9 busy on 4 replicas of ``model``: (scaled workload, config)."""
    from router.simulate import arrival_scale
    from router.workload import scale_arrivals
    workload = hot_group_workload()
    config = SimConfig(num_replicas=4, budget_tokens=20_000, replica_model=model, utilisation=0.9,
                       cost=CostModel(20_000.0, 0.002))
    return scale_arrivals(workload, arrival_scale(workload, config)), config


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_ours_fetches_and_peers_never_do(model):
    scaled, config = hot_group_run(model)
    ours = replay(scaled, config, "ours")
    assert ours["num_fetch_hints"] > 0 and ours["num_fetches"] > 0
    assert ours["fetched_tokens"] >= 1024 * ours["num_fetches"] * 0.5
    assert ours["fetched_rate"] <= ours["hit_rate"]
    nofetch = replay(scaled, config, "ours_nofetch")
    assert nofetch["num_fetch_hints"] == 0 and nofetch["fetched_tokens"] == 0
    for name in POLICY_NAMES:
        if not name.startswith("ours"):
            peer = replay(scaled, config, name)
            assert peer["fetched_tokens"] == 0 and peer["num_fetches"] == 0, name
            assert "num_fetch_hints" not in peer


def test_cli_fetch_flags_reach_the_replicas(tmp_path):
    """--fetch-bandwidth-gbps 0.001: every transfer is slower than recomputing, so every hint recomputes
    (or finds its owner evicted)."""
    import json

    from router.simulate import main
    # replicate_hot_prefixes off: it credits fetchable tokens to a hot prefix's new holder, so with every
    # hint recomputed the run is not the no-fetch one (the knob needs fetch that pays: PolicyConfig)
    args = ["--workload", "multi-turn", "--replicas", "4", "--budget-tokens", "4000", "--no-progress",
            "--policies", "ours,ours_nofetch", "--workload-args", '{"num_conversations": 24, "rate_per_s": 40.0}',
            "--policy-args", '{"replicate_hot_prefixes": false}']
    for gbps, tag in ((25.0, "fast"), (0.001, "slow")):
        out = tmp_path / f"{tag}.json"
        assert main(args + ["--json", str(out), "--fetch-bandwidth-gbps", str(gbps), "--kv-bytes-per-token",
                            "131072", "--fetch-export-fraction", "0.2"]) == 0
        result = json.loads(out.read_text())
        assert result["setup"]["fetch"] == {"kv_bytes_per_token": 131072, "bandwidth_bytes_per_s": gbps * 1e9,
                                            "latency_s": 0.001, "export_fraction": 0.2,
                                            "patience": 1.0, "prefill_patience": 3.0}
        ours, nofetch = result["policies"]["ours"], result["policies"]["ours_nofetch"]
        assert ours["num_fetch_hints"] > 0 and nofetch["num_fetch_hints"] == 0
        if tag == "fast":
            assert ours["num_fetches"] > 0
        else:
            assert ours["num_fetches"] == 0 and ours["fetched_tokens"] == 0 and ours["num_fetch_slower"] > 0
            assert (ours["num_fetch_slower"] + ours["num_fetch_evicted"] + ours["num_fetch_held"]
                    == ours["num_fetch_hints"])
            # the default fetch_credit_scope "never" changes no score and no booking: with every hint
            # recomputed, the replicas see the no-fetch run but for the round trip (1 ms) each hint whose
            # owner had evicted the prefix cost before it recomputed
            assert ours["hit_rate"] == nofetch["hit_rate"]
            for key in ("load_imbalance", "ttft_p50_s", "ttft_p99_s"):
                assert ours[key] == pytest.approx(nofetch[key], abs=ours["num_fetch_evicted"] * 0.001), key


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_a_prefix_recomputed_while_another_replica_held_it_is_counted_as_held_elsewhere(model):
    """The report's ``held_elsewhere`` figure reads the replicas' true caches when a request's outcome is
    fixed: tokens another replica held beyond what the request reused (cached or fetched)."""
    owner = warm_owner(model)  # holds PREFIX + 10 tokens
    receiver = make_replica(model, "receiver")
    third = make_replica(model, "third")
    for replica in (owner, receiver, third):
        replica.peers = tuple(peer for peer in (owner, receiver, third) if peer is not replica)
    receiver.submit(1, request(10.0, PREFIX + tuple(range(9000, 9010))), 10.0)  # no hint: recomputed
    receiver.submit(2, request(20.0, PREFIX + tuple(range(7000, 7010))), 20.0)  # its own copy now: a hit
    third.submit(3, request(30.0, PREFIX[:100] + tuple(range(8000, 8100))), 30.0,
                 SimFetch(owner, 100, FAST))  # fetched all that anyone held
    for replica in (receiver, third):
        replica.advance(math.inf)
    assert [receiver.outcomes[n].held_elsewhere_tokens for n in (1, 2)] == [400, 0]
    assert (third.outcomes[3].fetched_tokens, third.outcomes[3].held_elsewhere_tokens) == (100, 0)


def test_held_elsewhere_never_counts_past_the_last_prompt_token():
    owner = warm_owner("fifo")
    receiver = make_replica("fifo", "receiver")
    receiver.peers = (owner,)
    receiver.submit(1, request(10.0, PREFIX), 10.0)  # the owner holds all of it; the last token is computed
    assert receiver.outcomes[1].held_elsewhere_tokens == len(PREFIX) - 1


@pytest.mark.parametrize("model", ["fifo", "cb"])
def test_the_replay_reports_what_was_recomputed_while_held_elsewhere(model):
    scaled, config = hot_group_run(model)
    round_robin = replay(scaled, config, "round_robin")  # sends a group's prompts everywhere, cold or not
    ours = replay(scaled, config, "ours")
    # each of the 2 system prompts (1,024 tokens) is computed once on each of the 4 replicas under round
    # robin: 2 of those 8 are the first anywhere, the other 6 recompute what another replica held or was
    # still computing (not held: its KV did not exist yet)
    prompt_tokens = sum(r.num_prompt_tokens for r in scaled.requests)
    assert 0 < round_robin["held_elsewhere_rate"] <= 6 * 1024 / prompt_tokens
    assert ours["held_elsewhere_rate"] < round_robin["held_elsewhere_rate"] / 2
    for figures in (round_robin, ours):
        assert figures["hit_rate"] + figures["held_elsewhere_rate"] <= 1.0
