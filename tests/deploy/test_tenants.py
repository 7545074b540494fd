"""Tenants, in process (no Ray): ``cache_salt`` (body field or
``X-Cache-Salt`` header) isolates prefix caches, so one tenant's prompt never
reuses (or times) another's blocks; API keys from the config gate every
route but ``/health``. (Per-key namespaces: tests/reliability/test_security.py.)"""

from __future__ import annotations

import random

import pytest

KEYS = ("sk-tenants-1", "sk-tenants-2")


@pytest.fixture(scope="module")
def http(serve_in_process):
    with serve_in_process() as client:
        yield client


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(90_000 + seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def generate(http, prompt, *, salt=None, header_salt=None) -> dict:
    body = {"prompt_token_ids": prompt, "max_new_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {} if header_salt is None else {"X-Cache-Salt": header_salt}
    response = http.post("/generate", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_tenant_misses_another_tenants_cached_prompt_then_hits_its_own(http):
    prompt = tokens(1, 120)
    assert generate(http, prompt, salt="tenant-a")["cached_tokens"] == 0  # cold
    assert generate(http, prompt, salt="tenant-a")["cached_tokens"] >= len(prompt) - 1  # a's own: hit
    assert generate(http, prompt, salt="tenant-b")["cached_tokens"] == 0  # b never sees a's blocks
    assert generate(http, prompt)["cached_tokens"] == 0  # nor does the unsalted namespace
    assert generate(http, prompt, salt="tenant-b")["cached_tokens"] >= len(prompt) - 1  # b's own, now


def test_header_salt_isolates_like_the_body_field(http):
    prompt = tokens(2, 100)
    assert generate(http, prompt, header_salt="tenant-c")["cached_tokens"] == 0
    assert generate(http, prompt, salt="tenant-c")["cached_tokens"] >= len(prompt) - 1  # same tenant
    assert generate(http, prompt, header_salt="tenant-d")["cached_tokens"] == 0


def test_shared_system_prompt_is_cached_per_tenant(http):
    system = tokens(3, 96)
    first = generate(http, system + tokens(30, 10), salt="tenant-e")
    other = generate(http, system + tokens(31, 10), salt="tenant-f")
    again = generate(http, system + tokens(32, 10), salt="tenant-e")
    assert first["cached_tokens"] == 0 and other["cached_tokens"] == 0
    assert again["cached_tokens"] >= 96  # every full block of e's system prompt


def test_openai_route_honours_the_salt(http):
    messages = [{"role": "system", "content": "Tenant secret prompt. " * 6}, {"role": "user", "content": "Hi"}]

    def chat(salt):
        response = http.post("/v1/chat/completions", json={
            "model": "tiny-llama", "messages": messages, "max_tokens": 2, "temperature": 0, "cache_salt": salt})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert chat("tenant-g") == 0
    assert chat("tenant-h") == 0
    assert chat("tenant-g") > 0


@pytest.fixture(scope="module")
def keyed(serve_in_process):
    with serve_in_process(api_keys=KEYS) as client:
        yield client


@pytest.mark.parametrize("path,method", [("/generate", "POST"), ("/v1/completions", "POST"),
                                         ("/v1/chat/completions", "POST"), ("/generate_batch", "POST"),
                                         ("/v1/models", "GET"), ("/stats", "GET")])
def test_api_keys_gate_every_route(keyed, path, method):
    body = {"/generate": {"prompt_token_ids": [72, 105], "max_new_tokens": 1},
            "/generate_batch": {"prompts": [[72, 105]], "max_new_tokens": 1},
            "/v1/completions": {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1},
            "/v1/chat/completions": {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 1}}.get(path)

    def call(headers):
        return keyed.request(method, path, json=body, headers=headers)

    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Bearer"},
                    {"Authorization": f"Bearer {KEYS[0]}x"}):
        response = call(headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    for key in KEYS:  # any configured key
        assert call({"Authorization": f"Bearer {key}"}).status_code == 200


def test_health_needs_no_key(keyed):
    assert keyed.get("/health").status_code == 200
