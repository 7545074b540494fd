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

import random

import pytest

from harness.serving import ServeApp, config_engine_args, start_app

API_KEY = "sk-reliability-1"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CORE_LIMITS = {"max_prompt_tokens": 1024, "max_new_tokens": 64, "max_body_bytes": 65536,
               "max_batch_prompts": 16, "max_n": 4}
CORE_ENGINE = {"deterministic": True, "kv_pool_tokens": 1024, "cache_budget_tokens": 512, "max_batch_tokens": 256,
               "max_num_seqs": 16, "max_queued_requests": 256}
BODY_TIMEOUT_S = 2.0


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
