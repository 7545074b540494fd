"""The serving app, live: what needs Ray — routing across 2 Worker replicas
(deterministic mode), fan-out calls, streaming and cancellation through
Serve handles, the stats board, shutdown. Each route's shapes and errors are
tested in process, without Ray: tests/deploy/test_routes.py."""

from __future__ import annotations

import json
import random
import time

import httpx
import openai
import pytest

from harness.loadtest import main as loadtest
from harness.sse import DONE, sse_event

pytestmark = pytest.mark.ray

MODEL = "tiny-llama"


def post(app, path, body, **kwargs):
    return httpx.post(app.url + path, json=body, timeout=120, trust_env=False, **kwargs)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


# ------------------------------------------------------------------ basics
def test_stats_board_lists_both_replicas(live_app):
    assert httpx.get(live_app.url + "/health", trust_env=False).json() == {"status": "ok"}
    stats = httpx.get(live_app.url + "/stats", trust_env=False).json()
    assert len(stats["replicas"]) == 2
    for replica_id, replica in stats["replicas"].items():
        assert replica_id.startswith("SERVE_REPLICA::") and replica["replica_id"] == replica_id
        assert {"hits", "misses", "tokens_saved", "prefill_tokens", "cache_num_tokens", "pid"} <= set(replica)


def test_stats_show_what_the_ingress_router_reads(live_app):
    """/stats' ``routing``: the request router inside the Ingress replica
    that answered (Ray creates it with the handle's first request), over
    both Workers, each of which has reported a summary within a few routing
    periods; one Ingress, so one router's worth of traffic."""
    post(live_app, "/generate", {"prompt_token_ids": tokens(1, 200), "max_new_tokens": 2})
    deadline = time.time() + 20
    while True:
        routing = httpx.get(live_app.url + "/stats", trust_env=False).json()["routing"]
        if (len(routing) == 1 and routing[0]["replicas_reporting"] == 2) or time.time() > deadline:
            break
        time.sleep(0.5)
    (router,) = routing
    assert router["deployment"] == "Worker" and router["replicas"] == 2 and router["replicas_reporting"] == 2
    assert router["in_replica"].startswith("SERVE_REPLICA::") and "Ingress" in router["in_replica"]
    assert router["routers_seen"] == 1.0 and router["balance_busy_source"] == "own_spans"
    assert router["index_blocks"] > 0 and router["in_flight"] >= 0


def test_repeated_prompt_returns_to_its_replica_with_cached_prefix(live_app):
    prompt = tokens(2, 100)
    body = {"prompt_token_ids": prompt, "max_new_tokens": 4, "ignore_eos": True}
    first = post(live_app, "/generate", body).json()
    second = post(live_app, "/generate", body).json()
    assert second["replica_id"] == first["replica_id"]
    assert second["cached_tokens"] >= len(prompt) - 1
    assert second["token_ids"] == first["token_ids"]


def test_generate_batch_keeps_input_order_and_equals_single_requests(live_app):
    system = tokens(3, 64)
    prompts = [system + tokens(100 + i, 8 + i) for i in range(6)] + [tokens(200 + i, 20) for i in range(3)]
    random.Random(0).shuffle(prompts)
    batch = post(live_app, "/generate_batch", {"prompts": prompts, "max_new_tokens": 5, "logprobs": True}).json()
    assert len(batch["outputs"]) == len(prompts)
    for prompt, output in zip(prompts, batch["outputs"]):
        assert output["prompt_tokens"] == len(prompt)
        single = post(live_app, "/generate", {"prompt_token_ids": prompt, "max_new_tokens": 5, "logprobs": True}).json()
        assert output["token_ids"] == single["token_ids"]
        assert output["logprobs"] == single["logprobs"]  # deterministic mode: bit-identical


def test_streamed_generate_sends_each_token_then_summary(live_app):
    prompt = tokens(5, 20)
    body = {"prompt_token_ids": prompt, "max_new_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live_app.url + "/generate", json=body, timeout=60, trust_env=False) as response:
        events = [e for e in map(sse_event, response.iter_lines()) if e is not None]
    assert events.pop() == DONE
    token_events = [e for e in events if "token_id" in e and not e.get("done")]
    done = [e for e in events if e.get("done")]
    assert len(token_events) == 5 and len(done) == 1
    assert done[0]["token_ids"] == [e["token_id"] for e in token_events]


# ------------------------------------------------------------------ OpenAI
@pytest.fixture(scope="module")
def client(live_app):
    return openai.OpenAI(base_url=live_app.url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=120))


def test_openai_choices_fan_out_and_all_finish(client):
    completion = client.completions.create(model=MODEL, prompt="The cache", max_tokens=6, temperature=0, n=2)
    assert len(completion.choices) == 2
    assert completion.choices[0].text == completion.choices[1].text  # greedy
    usage = completion.usage
    assert usage.prompt_tokens >= len("The cache")  # byte-level: at least a token per byte
    assert 2 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# -------------------------------------------------------------- routing
# ---------------------------------------------------------- cancellation
def test_client_disconnect_cancels_and_frees_blocks(live_app):
    body = {"prompt_token_ids": tokens(7, 50), "max_new_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live_app.url + "/generate", json=body, timeout=60, trust_env=False) as response:
        for line in response.iter_lines():
            if '"token_id"' in line:
                break  # leave after the first token
    deadline = time.time() + 30
    while time.time() < deadline:
        replicas = httpx.get(live_app.url + "/stats", trust_env=False).json()["replicas"].values()
        if sum(r["num_aborted"] for r in replicas) >= 1 and all(r["num_running"] == 0 for r in replicas):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the abandoned stream kept running: {list(replicas)}")
    for replica in replicas:
        assert replica["decode_tokens"] < 400 * 10  # the 400-token request did not run to the end
    assert all(r["num_running"] == 0 and r["num_waiting"] == 0 for r in replicas)


# -------------------------------------------------------------- metrics
def test_prometheus_metrics_per_replica(live_app):
    post(live_app, "/generate", {"prompt_token_ids": tokens(8, 20), "max_new_tokens": 2})
    deadline = time.time() + 15  # the workers' figures reach the board once a stats period
    while True:
        text = httpx.get(live_app.url + "/metrics", trust_env=False).text
        if text.count('kvroute_cache_hit_requests_total{replica="SERVE_REPLICA::') == 2 or time.time() > deadline:
            break
        time.sleep(0.2)
    for name in ("kvroute_cache_hit_requests_total", "kvroute_cache_saved_tokens_total", "kvroute_prefill_tokens_total",
                 "kvroute_queue_depth", "kvroute_ttft_seconds_bucket", "kvroute_request_latency_seconds_count"):
        assert name in text, name
    assert text.count('kvroute_cache_hit_requests_total{replica="SERVE_REPLICA::') == 2


def test_workers_stream_their_cache_summaries(live_app):
    """deploy/config.yaml's summary_mode: stream: a whole summary per Worker while
    its cache is young or churns, else deltas (each naming a base in the object
    store), counted in /stats and /metrics."""
    post(live_app, "/generate", {"prompt_token_ids": tokens(9, 300), "max_new_tokens": 2})
    deadline = time.time() + 20
    while True:
        replicas = httpx.get(live_app.url + "/stats", trust_env=False).json()["replicas"].values()
        if all(r.get("summary_messages", 0) >= 4 for r in replicas) or time.time() > deadline:
            break
        time.sleep(0.3)
    for replica in replicas:
        assert replica["summary_messages"] - replica["summary_snapshots"] >= 3  # deltas
        assert replica["summary_bases_put"] >= 1 and replica["summary_bytes"] > 0
    assert "kvroute_summary_bytes_total{replica=" in httpx.get(live_app.url + "/metrics", trust_env=False).text


# ------------------------------------------------------------- shutdown (last)
def test_the_load_test_script_runs_against_the_app_and_logs_where_each_request_went(live_app, tmp_path):
    """``python -m harness.loadtest --url`` as a user runs it: closed-loop
    chats over real HTTP; the JSON lists every request (session, turn, the
    replica that served it, send time, TTFT, cached tokens) in send order."""
    out = tmp_path / "loadtest.json"
    workload = {"num_chats": 2, "num_turns": 3, "system_tokens": 128, "question_tokens": 32, "output_tokens": 8}
    assert loadtest(["--url", live_app.url, "--workload", "multi-turn", "--workload-args", json.dumps(workload),
                     "--concurrency", "2", "--warmup-requests", "0", "--json", str(out)]) == 0
    server = json.loads(out.read_text())["results"]["server"]
    log = server["request_log"]
    assert len(log) == 6  # every request answered and logged
    replicas = set(httpx.get(live_app.url + "/stats", trust_env=False).json()["replicas"])
    for session in (0, 1):
        rows = [row for row in log if row[0] == session]
        assert [row[1] for row in rows] == [0, 1, 2]  # a chat's turns go one after another
        assert all(row[2] in replicas and 0 < row[7] <= row[4] for row in rows)  # engine TTFT within the client's
        assert all(0 <= row[8] < row[7] for row in rows)  # of which waiting for a step: some, never all
        assert rows[1][6] > rows[0][6] + 8  # each turn's prompt holds the previous prompt and answer
    assert [row[3] for row in log] == sorted(row[3] for row in log) and log[0][3] == 0.0
    assert sum(row[5] for row in log) > 0  # later turns found their history cached


def test_zz_clean_shutdown_leaves_no_ray_processes(live_app):
    assert live_app.ray_pids(), "expected this test's Ray processes to be found while running"
    live_app.__exit__(None, None, None)
    deadline = time.time() + 20
    while live_app.ray_pids() and time.time() < deadline:
        time.sleep(0.5)
    assert live_app.ray_pids() == []
