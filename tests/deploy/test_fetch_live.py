"""A cached prefix fetched from the replica holding it, live (issue 13): two
deterministic Worker replicas behind our router, on an app of this module's
own. Run under the shared lock (tests/deploy/README.md).

Forcing the hint: with ``fetch_credit_scope`` "always", ``affinity_weight`` 1 and ``fetch_token_cost`` 0 the
router counts a prefix the candidate could fetch exactly like one it holds,
so the choice between owner and non-owner falls to the balance term, which
sends each request to the replica with less recent work. The tests run in
order and each step's target is the replica with less recent work by
construction (stated at each step); ``fetch_min_tokens`` 0 hints any
difference. The balance term reads recent work alone here (``balance_busy_share``
0): the steps are laid out in work, and a receiver's busy time includes its
wait for the fetch. A fresh receiver has measured no prefill yet, so it trusts the
hint (worker/kv_fetch.py, step 2); later ones have measured both rates, so
``fetch_min_speedup`` 0 makes every hinted request fetch whatever they say
(the measured decision is tested in process, tests/worker/test_kv_fetch.py).
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness.faults import replica_pids, replica_stats, wait_for_clean_audits
from harness.serving import config_engine_args, start_app
from worker import Engine, EngineConfig, reference

pytestmark = pytest.mark.ray

KEY_A, KEY_B = "sk-fetch-a", "sk-fetch-b"
AUTH_A, AUTH_B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
PREFIX_TOKENS = 512  # 8 routing blocks of 64
NEW_TOKENS = 8
FORCE_HINTS = {"affinity_weight": 1.0, "fetch_token_cost": 0.0, "fetch_min_tokens": 0,
               "fetch_credit_scope": "always",  # the credit against any owner (the default, "never", moves nothing)
               "balance_busy_share": 0.0}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


UNSEEN_FIRST_TOKENS = range(20, 26)  # below tokens()' range: no other prompt here starts with one


@pytest.fixture(scope="module")
def app():
    app = start_app(args_overrides={
        "engine": config_engine_args(deterministic=True), "router_kwargs": FORCE_HINTS,
        "api_keys": [KEY_A, KEY_B], "stats_period_s": 0.5, "fetch_timeout_s": 3.0, "fetch_min_speedup": 0.0,
    })
    yield app
    app.__exit__(None, None, None)


@pytest.fixture(scope="module")
def reference_engine():
    config = config_engine_args(deterministic=True)
    config.pop("num_threads", None)  # process-wide in torch: leave this test process alone
    return Engine(EngineConfig(**config))


@pytest.fixture(scope="module")
def served():
    """What earlier steps saw: replica ids by role."""
    return {}


def generate(app, prompt: list[int], headers: dict) -> dict:
    body = {"prompt_token_ids": prompt, "max_new_tokens": NEW_TOKENS, "logprobs": True}
    response = httpx.post(app.url + "/generate", json=body, headers=headers, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def assert_reference(out: dict, prompt: list[int], reference_engine) -> None:
    expected_tokens, expected_logprobs = reference.generate(reference_engine, prompt, NEW_TOKENS, logprobs=True)
    assert out["token_ids"] == expected_tokens and out["logprobs"] == expected_logprobs


def stats_when(app, condition, timeout_s: float = 20.0) -> dict[str, dict]:
    """/stats once ``condition(stats)`` holds (the board lags a stats period)."""
    deadline = time.monotonic() + timeout_s
    stats = replica_stats(app.url, AUTH_A)
    while not condition(stats) and time.monotonic() < deadline:
        time.sleep(0.25)
        stats = replica_stats(app.url, AUTH_A)
    return stats


def fallbacks(entry: dict) -> int:
    return sum(v for k, v in entry.items() if k.startswith("fetch_fallback_") and k != "fetch_fallback_slower")


def test_a_replica_that_never_saw_the_prefix_fetches_it_and_matches_the_reference(app, reference_engine, served):
    shared = tokens(1, PREFIX_TOKENS)
    first = generate(app, shared + tokens(2, 16), AUTH_A)  # cold: both idle, its ring home takes it
    owner = served["owner"] = first["replica_id"]
    assert first["cached_tokens"] == 0
    prompt = shared + tokens(3, 16)
    second = generate(app, prompt, AUTH_A)  # the other replica has no recent work: it wins, hinted
    receiver = served["receiver"] = second["replica_id"]
    assert receiver != owner, "the router did not spill the second request (FORCE_HINTS)"
    assert second["cached_tokens"] == PREFIX_TOKENS  # fetched, never computed there
    assert_reference(second, prompt, reference_engine)
    stats = stats_when(app, lambda s: s.get(receiver, {}).get("fetch_count", 0) >= 1
                       and s.get(owner, {}).get("fetch_exports", 0) >= 1)
    assert stats[receiver]["fetch_count"] == 1 and stats[receiver]["fetch_tokens"] == PREFIX_TOKENS
    assert stats[receiver]["fetch_bytes"] == PREFIX_TOKENS * stats[receiver]["kv_bytes_per_token"]
    assert stats[receiver]["fetch_seconds"] > 0 and stats[owner]["fetch_exports"] == 1
    assert stats[receiver]["fetch_bandwidth_bytes_per_s"] > 0
    print(f"FIGURES fetch live: {PREFIX_TOKENS} tokens, {stats[receiver]['fetch_bytes']} bytes in"
          f" {stats[receiver]['fetch_seconds'] * 1e3:.1f} ms (call + export + transfer + import);"
          f" estimate now {stats[receiver]['fetch_overhead_s'] * 1e3:.1f} ms +"
          f" bytes / {stats[receiver]['fetch_bandwidth_bytes_per_s'] / 1e6:.1f} MB/s")
    metrics = httpx.get(app.url + "/metrics", timeout=10, trust_env=False).text
    assert f'kvroute_fetched_tokens_total{{replica="{receiver}"}} {float(PREFIX_TOKENS)}' in metrics
    assert f'kvroute_fetch_exports_total{{replica="{owner}"}} 1.0' in metrics
    assert f'kvroute_fetch_fallbacks_total{{reason="timeout",replica="{receiver}"}} 0.0' in metrics
    for audit in wait_for_clean_audits(app.url, 2, after_s=time.time(), headers=AUTH_A):
        assert audit.is_clean, audit  # the import left no leaked or double-referenced block


def test_another_tenant_never_fetches_the_prefix(app, reference_engine, served):
    before = replica_stats(app.url, AUTH_A)
    prompt = tokens(1, PREFIX_TOKENS) + tokens(4, 16)  # the same tokens under another key's namespace
    out = generate(app, prompt, AUTH_B)
    assert out["cached_tokens"] == 0
    assert_reference(out, prompt, reference_engine)
    time.sleep(1.5)  # a few stats periods: a fetch would show by now
    after = replica_stats(app.url, AUTH_A)
    for replica_id in after:
        for key in ("fetch_count", "fetch_exports"):
            assert after[replica_id][key] == before[replica_id][key], (replica_id, key)
        assert fallbacks(after[replica_id]) == fallbacks(before[replica_id])
    served["tenant_b"] = out["replica_id"]


def test_an_owner_killed_before_the_fetch_costs_a_recompute_never_the_request(app, reference_engine, served):
    # Recent work now: the receiver served the fetched request (its suffix only) and tenant b's
    # cold one, the owner one cold request, so a new group's first request goes to the owner...
    assert served["tenant_b"] == served["receiver"], "tenant b's cold request went elsewhere: steps out of order"
    shared = tokens(5, PREFIX_TOKENS)
    first = generate(app, shared + tokens(6, 16), AUTH_A)
    owner, receiver = first["replica_id"], served["receiver"]
    assert owner == served["owner"]
    # ... and its second to the receiver, hinted to fetch from the owner, which is dead by then.
    pid = replica_pids(app.url, AUTH_A)[owner]
    assert pid in app.ray_pids()
    before = stats_when(app, lambda s: receiver in s)[receiver]
    os.kill(pid, signal.SIGKILL)
    prompt = shared + tokens(7, 16)
    out = generate(app, prompt, AUTH_A)
    assert out["replica_id"] == receiver and out["cached_tokens"] == 0  # recomputed
    assert_reference(out, prompt, reference_engine)
    after = stats_when(app, lambda s: fallbacks(s.get(receiver, before)) > fallbacks(before))[receiver]
    assert fallbacks(after) == fallbacks(before) + 1, {k: v for k, v in after.items() if k.startswith("fetch")}
    assert after["fetch_count"] == before["fetch_count"]


def test_a_prefix_its_owner_is_still_prefilling_is_fetched_once_computed(app, reference_engine, served):
    """A long prompt's prefill (4,000 tokens: eight 512-token steps) is under
    way at its home when a second prompt sharing its first 3,968 tokens
    arrives. The home has all the recent work, so the router sends the
    second to the other replica, hinted, and says the owner still computes
    the prefix (``FetchHint.owner_computing``); the owner's export waits
    for its prefill (``ExportRequest.wait_s``) and sends the whole prefix:
    computed once, and the output is the reference's. (The previous test
    killed a replica: until the Ingress's router routes over the one Serve
    started in its place, both prompts go to one replica; the pair is sent
    again, on a new prefix, a few times; so is a pair whose fetch came
    after the owner's prefill had finished, on a quick machine: its export
    had nothing to wait for. Each pair's prefix opens with a token no
    earlier prompt in this namespace opened with: a shared first token
    would be cached at the receiver, which then fetches one token fewer.)"""
    live = stats_when(app, lambda s: len(set(s) - {served["owner"]}) == 2, timeout_s=90.0)
    assert len(set(live) - {served["owner"]}) == 2, sorted(live)

    def counted(key: str, replica_id: str, stats: dict) -> int:
        return stats.get(replica_id, {}).get(key, 0) - before.get(replica_id, {}).get(key, 0)

    for attempt in range(6):
        shared = [UNSEEN_FIRST_TOKENS[attempt]] + tokens(100 + attempt, 3967)
        before = replica_stats(app.url, AUTH_A)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(generate, app, shared + tokens(200 + attempt, 32), AUTH_A)
            time.sleep(0.15)  # the first is admitted and prefilling at its home by now
            prompt = shared + tokens(300 + attempt, 16)
            second = generate(app, prompt, AUTH_A)
            first = first.result()
        owner, receiver = first["replica_id"], second["replica_id"]
        if receiver != owner:
            board = stats_when(app, lambda s: counted("fetch_tokens", receiver, s))  # the fetch, on the board
            if counted("fetch_export_waits", owner, board):
                break  # caught mid-prefill: the case this test is about
        time.sleep(3.0)
    assert receiver != owner, "the router never sent the second request to the other replica (FORCE_HINTS)"
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == len(shared)  # fetched, not recomputed
    assert_reference(second, prompt, reference_engine)
    after = stats_when(app, lambda s: counted("fetch_export_waits", owner, s) and counted("fetch_tokens", receiver, s))
    assert counted("fetch_export_waits", owner, after) == 1 and after[owner]["fetch_export_wait_prefill_seconds"] > 0
    assert counted("fetch_tokens", receiver, after) == len(shared) and counted("fetch_count", receiver, after) == 1
    for audit in wait_for_clean_audits(app.url, 2, after_s=time.time(), headers=AUTH_A):
        assert audit.is_clean, audit
