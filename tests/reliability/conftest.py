"""Live apps for the reliability tests, brought up as the README does
(``ray start --head`` on free ports, ``serve run --non-blocking``), loopback
only, and stopped by this run's own Ray PIDs.

``core_app`` (2 deterministic Workers, a small KV pool, low limits, API keys,
a short body timeout) is shared by the modules that only send requests
(hostile input, tenants, integrity, KV exhaustion). Modules that measure the
machine (overload) or break replicas start their own app and first stop the
shared one (``exclusive``), so no other app competes for the 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from harness.serving import ServeApp, config_engine_args, start_app

API_KEY = "sk-reliability-1"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CORE_LIMITS = {"max_prompt_tokens": 1024, "max_new_tokens": 64, "max_body_bytes": 65536,
               "max_batch_prompts": 16, "max_n": 4}
CORE_ENGINE = {"deterministic": True, "kv_pool_tokens": 1024, "cache_budget_tokens": 512, "max_batch_tokens": 256,
               "max_num_seqs": 16, "max_queued_requests": 256}
BODY_TIMEOUT_S = 2.0
# An app whose admission takes 1 worker request per Worker: 2 at once on 2 Workers, the rest refused
ADMIT_TWO_ARGS = {"max_in_flight_per_worker": 1, "api_keys": [API_KEY], "stats_period_s": 0.5}


_shared: dict[str, ServeApp] = {}


def _close_shared() -> None:
    app = _shared.pop("core", None)
    if app is not None:
        app.__exit__(None, None, None)


@pytest.fixture(scope="module")
def core_app() -> ServeApp:
    if "core" not in _shared:
        _shared["core"] = start_app(args_overrides={
            "engine": config_engine_args(**CORE_ENGINE), "limits": CORE_LIMITS, "api_keys": [API_KEY, "sk-reliability-2"],
            "body_timeout_s": BODY_TIMEOUT_S, "stats_period_s": 0.5,
        })
    return _shared["core"]


@pytest.fixture(scope="module")
def exclusive() -> None:
    """This module measures or breaks its own app: stop the shared one first."""
    _close_shared()


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_app_at_end():
    yield
    _close_shared()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def post_with_key(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, headers=AUTH, timeout=60, trust_env=False)


def assert_burst_is_served_or_refused_as_json(url: str, count: int = 12) -> list[int]:
    """Send ``count`` requests at once to ``url``/generate of an app admitting
    2: some are served, the rest get kvroute's JSON 429 ``overloaded`` with
    ``Retry-After`` (nothing else); then a lone request is admitted again
    (the admission's counter is back at zero). The statuses, sorted."""
    body = {"prompt_token_ids": [50, 51, 52], "max_new_tokens": 48, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{url}/generate", json=body, headers=AUTH)
                                          for _ in range(count)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}, statuses
    for response in responses:
        if response.status_code != 429:
            continue
        assert response.headers["retry-after"] == "1"
        assert response.headers["content-type"] == "application/json"
        error = json.loads(response.content)["error"]
        assert error["code"] == "overloaded" and error["type"] == "rate_limit_error", error
    assert post_with_key(f"{url}/generate", body).status_code == 200
    return statuses
