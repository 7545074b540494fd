"""Tenants: ``cache_salt`` (body field or ``X-Cache-Salt`` header) isolates
prefix caches, so one tenant's prompt never reuses (or times) another's
blocks; API keys from the config gate every route but ``/health``."""

from __future__ import annotations

import httpx
import pytest

from tests.reliability.conftest import AUTH, tokens

pytestmark = pytest.mark.ray


def generate(app, prompt, *, salt=None, header_salt=None, headers=None):
    body = {"prompt_token_ids": prompt, "max_new_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    headers = dict(AUTH if headers is None else headers)
    if header_salt is not None:
        headers["X-Cache-Salt"] = header_salt
    response = httpx.post(app.url + "/generate", json=body, headers=headers, timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_tenant_misses_another_tenants_cached_prompt_then_hits_its_own(core_app):
    prompt = tokens(1, 120)
    assert generate(core_app, prompt, salt="tenant-a")["cached_tokens"] == 0  # cold
    assert generate(core_app, prompt, salt="tenant-a")["cached_tokens"] >= len(prompt) - 1  # a's own: hit
    assert generate(core_app, prompt, salt="tenant-b")["cached_tokens"] == 0  # b never sees a's blocks
    assert generate(core_app, prompt)["cached_tokens"] == 0  # nor does the unsalted namespace
    assert generate(core_app, prompt, salt="tenant-b")["cached_tokens"] >= len(prompt) - 1  # b's own, now


def test_header_salt_isolates_like_the_body_field(core_app):
    prompt = tokens(2, 100)
    assert generate(core_app, prompt, header_salt="tenant-c")["cached_tokens"] == 0
    assert generate(core_app, prompt, salt="tenant-c")["cached_tokens"] >= len(prompt) - 1  # same tenant
    assert generate(core_app, prompt, header_salt="tenant-d")["cached_tokens"] == 0


def test_shared_system_prompt_is_cached_per_tenant(core_app):
    system = tokens(3, 96)
    first = generate(core_app, system + tokens(30, 10), salt="tenant-e")
    other = generate(core_app, system + tokens(31, 10), salt="tenant-f")
    again = generate(core_app, system + tokens(32, 10), salt="tenant-e")
    assert first["cached_tokens"] == 0 and other["cached_tokens"] == 0
    assert again["cached_tokens"] >= 96  # every full block of e's system prompt


def test_openai_route_honours_the_salt(core_app):
    messages = [{"role": "system", "content": "Tenant secret prompt. " * 6}, {"role": "user", "content": "Hi"}]

    def chat(salt):
        response = httpx.post(core_app.url + "/v1/chat/completions", headers=AUTH, timeout=60, trust_env=False, json={
            "model": "tiny-llama", "messages": messages, "max_tokens": 2, "temperature": 0, "cache_salt": salt})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert chat("tenant-g") == 0
    assert chat("tenant-h") == 0
    assert chat("tenant-g") > 0


@pytest.mark.parametrize("path,method", [("/generate", "POST"), ("/v1/completions", "POST"),
                                         ("/v1/chat/completions", "POST"), ("/generate_batch", "POST"),
                                         ("/v1/models", "GET"), ("/stats", "GET")])
def test_api_keys_gate_every_route(core_app, path, method):
    body = {"/generate": {"prompt_token_ids": [72, 105], "max_new_tokens": 1},
            "/generate_batch": {"prompts": [[72, 105]], "max_new_tokens": 1},
            "/v1/completions": {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1},
            "/v1/chat/completions": {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 1}}.get(path)

    def call(headers):
        return httpx.request(method, core_app.url + path, json=body, headers=headers, timeout=60, trust_env=False)

    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Bearer"},
                    {"Authorization": "Bearer sk-reliability-1x"}):
        response = call(headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert call(AUTH).status_code == 200
    assert call({"Authorization": "Bearer sk-reliability-2"}).status_code == 200  # any configured key


def test_health_needs_no_key(core_app):
    assert httpx.get(core_app.url + "/health", trust_env=False).status_code == 200
