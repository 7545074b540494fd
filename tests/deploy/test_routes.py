"""Every route's success, streaming and error shapes, in process: the real
FastAPI app over the real engine (deterministic tiny-llama) through
``harness.engine_client.EngineClient`` — no Ray. The live suite keeps only
what needs Ray (routing across replicas, failures)."""

from __future__ import annotations

import json
import random

import openai
import pytest

from deploy.settings import Limits
from harness.sse import DONE, sse_events

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def http(serve_in_process):
    with serve_in_process(limits=Limits(max_body_bytes=1 << 20)) as client:
        yield client


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def assert_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


# ------------------------------------------------------------------ basics
def test_health_models_stats_and_metrics(http):
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, 1024)]
    http.post("/generate", json={"prompt_token_ids": tokens(9, 20), "max_new_tokens": 2})
    stats = http.get("/stats").json()
    assert (stats["model"], stats["router"], list(stats["replicas"])) == (MODEL, "kvroute", ["local"])
    replica = stats["replicas"]["local"]
    assert {"hits", "misses", "tokens_saved", "prefill_tokens", "cache_num_tokens", "pid", "age_s",
            "decode_token_cost", "queue_token_cost"} <= set(replica)
    assert stats["totals"]["prefill_tokens"] == replica["prefill_tokens"] > 0
    text = http.get("/metrics").text
    for name in ("kvroute_cache_hit_requests_total", "kvroute_cache_saved_tokens_total", "kvroute_prefill_tokens_total",
                 "kvroute_queue_depth", "kvroute_ttft_seconds_bucket", "kvroute_request_latency_seconds_count",
                 'kvroute_decode_token_cost{replica="local"}', 'kvroute_queue_token_cost{replica="local"}',
                 'kvroute_engine_phase_seconds_count{phase="prefill",replica="local"}',
                 'kvroute_outside_engine_seconds_count{replica="local"}'):
        assert name in text, name
    assert 'kvroute_cache_hit_requests_total{replica="local"}' in text


def test_generate_returns_contract_fields_and_hits_on_repeat(http):
    body = {"prompt_token_ids": tokens(1, 100), "max_new_tokens": 6, "ignore_eos": True, "logprobs": True}
    first = http.post("/generate", json=body).json()
    assert set(first) == {"token_ids", "replica_id", "cached_tokens", "prompt_tokens", "finish_reason", "logprobs"}
    assert (len(first["token_ids"]), first["prompt_tokens"], first["replica_id"]) == (6, 100, "local")
    assert first["finish_reason"] == "length" and len(first["logprobs"]) == 6
    second = http.post("/generate", json=body).json()
    assert second["cached_tokens"] >= 99 and second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]  # deterministic mode: bit-identical


def test_streamed_generate_sends_each_token_then_summary(http):
    body = {"prompt_token_ids": tokens(5, 20), "max_new_tokens": 5, "stream": True, "ignore_eos": True}
    response = http.post("/generate", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events.pop() == DONE
    assert [e["index"] for e in events[:-1]] == [0, 1, 2, 3, 4]
    assert all(e["replica_id"] == "local" for e in events)
    done = events[-1]
    assert done["done"] is True and done["token_ids"] == [e["token_id"] for e in events[:-1]]


def test_a_long_stream_in_lists_sends_every_token_once_in_order(http, sdk):
    """The worker sends a stream's tokens in lists (``stream_interval_ms``, 100
    here as in the config): still one SSE event per token, the same tokens as
    without streaming; the OpenAI SDK's chunks add up to the whole text."""
    body = {"prompt_token_ids": tokens(9, 30), "max_new_tokens": 64, "ignore_eos": True}
    whole = http.post("/generate", json=body).json()
    events = sse_events(http.post("/generate", json={**body, "stream": True}).text)
    assert events.pop() == DONE
    assert [e["index"] for e in events[:-1]] == list(range(64))
    assert [e["token_id"] for e in events[:-1]] == events[-1]["token_ids"] == whole["token_ids"]
    messages = [{"role": "user", "content": "Tell me a long story"}]
    text = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0).choices[0].message.content
    chunks = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_generate_batch_keeps_input_order_and_reports_bad_items_in_place(http):
    system = tokens(3, 64)
    prompts = [system + tokens(100 + i, 8 + i) for i in range(4)] + [tokens(200, 20), [10**6], tokens(201, 12)]
    random.Random(0).shuffle(prompts)
    outputs = http.post("/generate_batch", json={"prompts": prompts, "max_new_tokens": 4, "logprobs": True}).json()["outputs"]
    assert len(outputs) == len(prompts)
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        if prompt == [10**6]:
            assert output["error"]["param"] == f"prompts[{index}]" and "vocabulary" in output["error"]["message"]
            continue
        single = http.post("/generate", json={"prompt_token_ids": prompt, "max_new_tokens": 4, "logprobs": True}).json()
        assert (output["token_ids"], output["logprobs"]) == (single["token_ids"], single["logprobs"])
        assert output["prompt_tokens"] == len(prompt)


# ------------------------------------------------------------------ OpenAI
@pytest.fixture(scope="module")
def sdk(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)


def test_openai_completions(sdk):
    completion = sdk.completions.create(model=MODEL, prompt="The cache", max_tokens=6, temperature=0, n=2, logprobs=1)
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text == completion.choices[1].text  # greedy
    assert len(completion.choices[0].logprobs.token_logprobs) == completion.usage.completion_tokens // 2
    usage = completion.usage
    assert usage.prompt_tokens >= len("The cache")  # byte-level: at least a token per byte
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    seeded = dict(model=MODEL, prompt="Seeded", max_tokens=8, temperature=1.0, seed=1234)
    assert sdk.completions.create(**seeded).choices[0].text == sdk.completions.create(**seeded).choices[0].text


def test_openai_chat_and_cached_tokens_in_usage(sdk):
    messages = [{"role": "system", "content": "You are a cache. " * 8}, {"role": "user", "content": "Hi"}]
    first = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens - 1 <= second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens


def test_openai_streaming_completions_and_chat(sdk):
    whole = sdk.completions.create(model=MODEL, prompt="Stream me", max_tokens=8, temperature=0)
    pieces = list(sdk.completions.create(model=MODEL, prompt="Stream me", max_tokens=8, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    chunks = list(sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_openai_ignore_eos_runs_to_max_tokens(sdk):
    """vLLM's ``ignore_eos`` extra (``vllm bench serve --ignore-eos`` sends it):
    a sampled completion that ended on EOS runs to ``max_tokens`` with it."""
    for seed in range(40):
        ended = sdk.completions.create(model=MODEL, prompt="Once upon", max_tokens=200, temperature=1.0, seed=seed)
        if ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 200:
            break
    else:
        pytest.fail("no seed ended on EOS before 200 tokens: nothing to test ignore_eos against")
    for extra in ({"ignore_eos": True}, {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}):
        out = sdk.completions.create(model=MODEL, prompt="Once upon", max_tokens=200, temperature=1.0, seed=seed,
                                     extra_body={"ignore_eos": True}, **{k: v for k, v in extra.items() if k != "ignore_eos"})
        if extra.get("stream"):
            chunks = list(out)
            assert chunks[-1].usage.completion_tokens == 200
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        else:
            assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (200, "length")
            assert out.choices[0].text.startswith(ended.choices[0].text)  # the same draws up to the EOS
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=50,
                                       temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (50, "length")


def test_openai_stop_string_cuts_text(sdk):
    whole = sdk.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0).choices[0].text
    assert len(whole) >= 4, f"the model produced too little text to test stop strings: {whole!r}"
    stop = whole[2:4]
    for stream in (False, True):
        if stream:
            chunks = sdk.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, stop=[stop], stream=True)
            text, finish = "".join(c.choices[0].text for c in chunks if c.choices), "stop"
        else:
            cut = sdk.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, stop=[stop])
            text, finish = cut.choices[0].text, cut.choices[0].finish_reason
        assert (text, finish) == (whole[: whole.index(stop)], "stop")


def test_openai_unknown_model_is_404(sdk):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
    assert "gpt-nope" in str(info.value)


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
    ("/generate", {"prompt_token_ids": [1] * 1000, "max_new_tokens": 100}, 400),  # over the context length
    ("/generate", {"prompt_token_ids": [1], "max_new_tokens": 4, "temperature": -1}, 422),
    ("/generate", {"prompt_token_ids": [1], "max_new_tokens": 4, "stop_token_ids": [10**6]}, 400),
    ("/generate_batch", {"prompts": [], "max_new_tokens": 4}, 422),
    ("/generate_batch", {"prompts": [[1]] * 300, "max_new_tokens": 4}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, 422),
    ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 5}, 422),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**7}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 9}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("/v1/completions", {"model": "unknown", "prompt": "x"}, 404),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 422),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 422),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD_BODIES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_BODIES)])
def test_bad_input_gets_openai_style_4xx(http, path, body, status):
    assert_error(http.post(path, json=body), status)


def test_malformed_json_oversized_body_and_the_server_keeps_serving(http):
    assert_error(http.post("/generate", content=b"{not json", headers={"content-type": "application/json"}), 400)
    huge = {"prompt_token_ids": [1] * 600_000, "max_new_tokens": 1}  # 1.2 MB of compact JSON > 1 MiB
    error = assert_error(http.post("/generate", content=json.dumps(huge, separators=(",", ":"))), 413)
    assert "larger than" in error["message"]
    out = http.post("/generate", json={"prompt_token_ids": tokens(6, 10), "max_new_tokens": 3, "ignore_eos": True})
    assert out.status_code == 200 and len(out.json()["token_ids"]) == 3
