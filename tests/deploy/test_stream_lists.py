"""Streamed answers follow the worker's lists: the tokens that arrive together
(``stream_interval_ms``) leave the ingress as one message. An OpenAI stream
sends them as one chunk whose delta holds all their text (vLLM's
``--stream-interval`` does the same); ``/generate`` keeps one SSE event per
token. Same text, tokens and logprobs as before, fewer messages: the ingress's
CPU per token is ``python -m harness.sse_bench``'s figure.

The worker here is :class:`harness.sse_bench.ReplayClient` (every answer a
fixed output in lists of a fixed size), so the lists are known exactly."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from harness.sse_bench import build

NUM_TOKENS = 30


def _events(response) -> list:
    assert response.status_code == 200, response.text
    payloads = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


@pytest.fixture(scope="module")
def apps():
    """Clients of the ingress over workers that send 1 and 4 tokens a list."""
    return {per_list: TestClient(build(per_list, NUM_TOKENS)) for per_list in (1, 4)}


def _chat(client, **extra):
    body = {"model": "tiny-llama", "max_tokens": NUM_TOKENS, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello"}], **extra}
    return _events(client.post("/v1/chat/completions", json=body))


def test_a_chat_chunk_carries_every_token_of_its_list(apps):
    one, four = _chat(apps[1], logprobs=True), _chat(apps[4], logprobs=True)
    content = [e["choices"][0] for e in four if e["choices"][0]["delta"].get("content")]
    assert len(content) == -(-NUM_TOKENS // 4)  # 8 chunks of up to 4 tokens, not 30
    assert [len(c["logprobs"]["content"]) for c in content] == [4] * 7 + [2]
    text = "".join(c["delta"]["content"] for c in content)
    assert text == "".join(e["choices"][0]["delta"].get("content", "") for e in one)  # the same text
    assert [t["token"] for c in content for t in c["logprobs"]["content"]] == [
        t["token"] for e in one for t in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert four[-1]["choices"][0]["finish_reason"] == "length"


def test_a_completion_chunk_carries_every_token_of_its_list_and_usage_counts_them(apps):
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": NUM_TOKENS, "stream": True, "ignore_eos": True,
            "logprobs": 1, "stream_options": {"include_usage": True}}
    events = _events(apps[4].post("/v1/completions", json=body))
    chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["text"]]
    assert len(chunks) == 8 and sum(len(c["logprobs"]["token_logprobs"]) for c in chunks) == NUM_TOKENS
    assert events[-1]["usage"]["completion_tokens"] == NUM_TOKENS
    whole = apps[4].post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


def test_a_stop_string_inside_a_list_ends_the_chunk_before_it(apps):
    full = "".join(e["choices"][0]["delta"].get("content", "") for e in _chat(apps[1]))
    stop = full[9:11]  # inside the third list of 4 (a byte-level tokenizer: one character per token)
    events = _chat(apps[4], stop=[stop])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == full[: full.index(stop)] and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_generate_keeps_one_event_per_token(apps):
    body = {"prompt_token_ids": list(range(65, 80)), "max_new_tokens": NUM_TOKENS, "stream": True}
    events = _events(apps[4].post("/generate", json=body))
    assert [e["index"] for e in events[:-1]] == list(range(NUM_TOKENS)) and events[-1]["done"] is True


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions", "/v1/completions"])
def test_each_list_leaves_the_ingress_as_one_message(route):
    """Counted at the ASGI boundary (what Serve's replica ships to its proxy):
    one body message per list, plus the role chunk (chat) and ``[DONE]``."""
    import asyncio

    from harness.sse_bench import body_for, call

    body = json.dumps(body_for(route, NUM_TOKENS)).encode()
    status, messages, events = asyncio.run(call(build(4, NUM_TOKENS), route, body))
    lists = -(-NUM_TOKENS // 4)
    assert status == 200 and messages <= lists + 2, (messages, events)
    assert events == (NUM_TOKENS + 2 if route == "/generate" else messages)  # tokens + summary + [DONE]
