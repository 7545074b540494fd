"""The serving app, live: every route over real HTTP against real Ray Serve
replicas running the real engine (deterministic mode, 2 Worker replicas)."""

from __future__ import annotations

import json
import random
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.ray

MODEL = "tiny-llama"


def post(app, path, body, **kwargs):
    return httpx.post(app.url + path, json=body, timeout=120, trust_env=False, **kwargs)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def assert_error(response, status: int):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


# ------------------------------------------------------------------ basics
def test_health_models_and_stats(live_app):
    assert httpx.get(live_app.url + "/health", trust_env=False).json() == {"status": "ok"}
    models = httpx.get(live_app.url + "/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    stats = httpx.get(live_app.url + "/stats", trust_env=False).json()
    assert len(stats["replicas"]) == 2
    for replica in stats["replicas"].values():
        assert {"hits", "misses", "tokens_saved", "prefill_tokens", "cached_tokens"} <= set(replica)


def test_generate_returns_contract_fields(live_app):
    prompt = tokens(1, 30)
    out = post(live_app, "/generate", {"prompt_token_ids": prompt, "max_new_tokens": 6, "ignore_eos": True}).json()
    assert set(out) >= {"token_ids", "replica_id", "cached_tokens", "prompt_tokens"}
    assert len(out["token_ids"]) == 6
    assert out["prompt_tokens"] == 30
    assert out["replica_id"].startswith("SERVE_REPLICA::")


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


def test_generate_batch_reports_bad_items_in_place(live_app):
    good = tokens(4, 10)
    out = post(live_app, "/generate_batch", {"prompts": [good, [10**9], good], "max_new_tokens": 2}).json()["outputs"]
    assert len(out[0]["token_ids"]) >= 1 and len(out[2]["token_ids"]) >= 1
    assert "vocabulary" in out[1]["error"]["message"]


def test_streamed_generate_sends_each_token_then_summary(live_app):
    prompt = tokens(5, 20)
    body = {"prompt_token_ids": prompt, "max_new_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live_app.url + "/generate", json=body, timeout=60, trust_env=False) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    token_events = [e for e in events if "token_id" in e and not e.get("done")]
    done = [e for e in events if e.get("done")]
    assert len(token_events) == 5 and len(done) == 1
    assert done[0]["token_ids"] == [e["token_id"] for e in token_events]


# ------------------------------------------------------------------ OpenAI
@pytest.fixture(scope="module")
def client(live_app):
    return openai.OpenAI(base_url=live_app.url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=120))


def test_openai_completions(client):
    completion = client.completions.create(model=MODEL, prompt="The cache", max_tokens=6, temperature=0, n=2)
    assert len(completion.choices) == 2
    assert completion.choices[0].text == completion.choices[1].text  # greedy
    usage = completion.usage
    assert usage.prompt_tokens >= len("The cache")  # byte-level: at least a token per byte
    assert 2 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_openai_completions_seed_reproduces_sampling(client):
    kwargs = dict(model=MODEL, prompt="Seeded", max_tokens=8, temperature=1.0, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text


def test_openai_chat_and_cached_tokens_in_usage(client):
    messages = [{"role": "system", "content": "You are a cache. " * 8}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.choices[0].message.role == "assistant"
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 1


def test_openai_streaming_completions_and_chat(client):
    whole = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=8, temperature=0)
    pieces = list(client.completions.create(model=MODEL, prompt="Stream me", max_tokens=8, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_openai_stop_string_cuts_text(client):
    whole = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0).choices[0].text
    if len(whole) < 4:
        pytest.fail(f"the model produced too little text to test stop strings: {whole!r}")
    stop = whole[2:4]
    cut = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[: whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_openai_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
    assert "gpt-nope" in str(info.value)


# -------------------------------------------------------------- routing
def test_prefix_groups_stick_while_both_replicas_get_work(live_app):
    groups = {g: tokens(1000 + g, 96) for g in range(6)}
    order = [(g, i) for g in groups for i in range(4)]
    random.Random(1).shuffle(order)
    group_to_replicas: dict[int, list[str]] = {g: [] for g in groups}
    for g, i in order:
        out = post(live_app, "/generate", {"prompt_token_ids": groups[g] + tokens(5000 + 10 * g + i, 8), "max_new_tokens": 2}).json()
        group_to_replicas[g].append(out["replica_id"])
    for g, replicas in group_to_replicas.items():
        assert len(set(replicas[1:])) == 1, f"group {g} did not stick after its first request: {replicas}"
    homes = {replicas[-1] for replicas in group_to_replicas.values()}
    assert len(homes) == 2, f"one replica got every group: {group_to_replicas}"


# ------------------------------------------------------------ bad input
BAD_BODIES = [
    ("/generate", {"prompt_token_ids": [], "max_new_tokens": 4}, 422),
    ("/generate", {"max_new_tokens": 4}, 422),
    ("/generate", {"prompt_token_ids": "abc", "max_new_tokens": 4}, 422),
    ("/generate", {"prompt_token_ids": [1, 2, "x"], "max_new_tokens": 4}, 422),
    ("/generate", {"prompt_token_ids": [1.5], "max_new_tokens": 4}, 422),
    ("/generate", {"prompt_token_ids": [1, 2], "max_new_tokens": -1}, 422),
    ("/generate", {"prompt_token_ids": [1, 2], "max_new_tokens": 10**9}, 400),
    ("/generate", {"prompt_token_ids": [1, 10**6], "max_new_tokens": 4}, 400),
    ("/generate", {"prompt_token_ids": [-1], "max_new_tokens": 4}, 400),
    ("/generate", {"prompt_token_ids": [1], "max_new_tokens": 4, "temperature": -1}, 422),
    ("/generate_batch", {"prompts": [], "max_new_tokens": 4}, 422),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, 422),
    ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 5}, 422),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**7}, 400),
    ("/v1/completions", {"model": "unknown", "prompt": "x"}, 404),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 422),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 422),
]


@pytest.mark.parametrize("path,body,status", BAD_BODIES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_BODIES)])
def test_bad_input_gets_openai_style_4xx(live_app, path, body, status):
    assert_error(post(live_app, path, body), status)


def test_malformed_json_and_oversized_body(live_app):
    response = httpx.post(live_app.url + "/generate", content=b"{not json", headers={"content-type": "application/json"}, trust_env=False)
    assert_error(response, 400)
    huge = {"prompt_token_ids": [1] * 600_000, "max_new_tokens": 1}  # 1.2 MB of compact JSON > 1 MiB
    assert_error(post(live_app, "/generate", huge), 413)


def test_server_keeps_serving_after_bad_input(live_app):
    for path, body, _ in BAD_BODIES:
        post(live_app, path, body)
    out = post(live_app, "/generate", {"prompt_token_ids": tokens(6, 10), "max_new_tokens": 3, "ignore_eos": True})
    assert out.status_code == 200 and len(out.json()["token_ids"]) == 3


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
    time.sleep(2.5)  # one stats period for the workers' figures to reach the board
    text = httpx.get(live_app.url + "/metrics", trust_env=False).text
    for name in ("kvroute_cache_hits_total", "kvroute_tokens_saved_total", "kvroute_prefill_tokens_total",
                 "kvroute_queue_depth", "kvroute_ttft_seconds_bucket", "kvroute_request_latency_seconds_count"):
        assert name in text, name
    assert text.count('kvroute_cache_hits_total{replica="SERVE_REPLICA::') == 2


# ------------------------------------------------------------- shutdown (last)
def test_zz_clean_shutdown_leaves_no_ray_processes(live_app):
    assert live_app.ray_pids(), "expected this test's Ray processes to be found while running"
    live_app.__exit__(None, None, None)
    deadline = time.time() + 20
    while live_app.ray_pids() and time.time() < deadline:
        time.sleep(0.5)
    assert live_app.ray_pids() == []
