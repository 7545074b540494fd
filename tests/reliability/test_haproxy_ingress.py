"""Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``,
``harness/haproxy_ingress.py``), live: HAProxy, not Serve's Python proxy,
answers on the app's port and forwards each request to the Ingress replica's
own HTTP server, so the excess is refused by kvroute's admission — JSON 429
``overloaded`` with ``Retry-After`` — on the port clients always use, with no
Python proxy or Ray call before it (RELIABILITY.md section 2 has what that
saves). HAProxy's own stats page shows the requests went through it: a plain
app has no HAProxy and no such page."""

from __future__ import annotations

import asyncio
import csv
import io
import time

import httpx
import pytest

from harness.abandon_probe import abandon_streams
from harness.faults import replica_stats
from harness.haproxy_ingress import HAProxyApp
from tests.reliability.conftest import (
    ADMIT_TWO_ARGS, AUTH, assert_burst_is_served_or_refused_as_json, post_with_key,
)


@pytest.fixture(scope="module")
def app(exclusive):
    app = HAProxyApp(num_cpus=2, args_overrides=ADMIT_TWO_ARGS)
    with app:
        app.deploy()
        yield app


def _ingress_sessions(app: HAProxyApp) -> dict[str, int]:
    """HAProxy's total sessions per server of the app's backend (its stats page as CSV)."""
    port = app.ports["RAY_SERVE_HAPROXY_STATS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/stats;csv", timeout=10, trust_env=False).text
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {row["svname"]: int(row["stot"] or 0) for row in rows
            if row["pxname"] == "http-kvroute" and row["svname"].startswith("SERVE_REPLICA")}


@pytest.mark.ray
def test_haproxy_answers_the_apps_port_and_forwards_to_the_ingress_replica(app):
    before = _ingress_sessions(app)
    assert len(before) == 1 and all("Ingress" in name for name in before), before  # one Ingress replica, UP
    body = {"prompt_token_ids": [40, 41, 42, 43], "max_new_tokens": 4, "ignore_eos": True}
    response = post_with_key(f"{app.url}/generate", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["token_ids"]) == 4
    completion = post_with_key(f"{app.url}/v1/completions",
                               {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    # kvroute's auth, not Serve's: a bad key is the OpenAI-style 401
    bad = httpx.post(f"{app.url}/generate", json=body, headers={"Authorization": "Bearer nope"}, timeout=30,
                     trust_env=False)
    assert bad.status_code == 401 and "error" in bad.json()
    after = _ingress_sessions(app)
    assert sum(after.values()) >= sum(before.values()) + 1, (before, after)  # kept-alive: >= 1 new session


@pytest.mark.ray
def test_the_excess_gets_kvroutes_json_429_through_haproxy(app):
    statuses = assert_burst_is_served_or_refused_as_json(app.url)
    print("FIGURES haproxy_ingress burst:", statuses)


@pytest.mark.ray
def test_a_cancelled_stream_through_haproxy_is_aborted_and_frees_its_slot(app):
    """HAProxy passes the client's disconnect on (``option abortonclose``):
    the Workers abort both streams (``num_aborted``) and the admission slots
    they held are free again for the next requests."""
    body = {"prompt_token_ids": [60, 61, 62], "max_new_tokens": 1024, "ignore_eos": True, "stream": True}
    short = {"prompt_token_ids": [70, 71], "max_new_tokens": 2, "ignore_eos": True}
    aborted_before = sum(s["num_aborted"] for s in replica_stats(app.url, AUTH).values())

    async def hang_up_then_send() -> list[int]:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            streams = [client.stream("POST", f"{app.url}/generate", json=body, headers=AUTH) for _ in range(2)]
            for stream in streams:  # both admission slots held
                response = await stream.__aenter__()
                assert response.status_code == 200
                await anext(response.aiter_bytes())
            for stream in streams:
                await stream.__aexit__(None, None, None)  # hang up mid-stream
            deadline = time.monotonic() + 20
            while True:
                statuses = [(await client.post(f"{app.url}/generate", json=short, headers=AUTH)).status_code
                            for _ in range(2)]
                if statuses == [200, 200] or time.monotonic() > deadline:
                    return statuses
                await asyncio.sleep(0.2)

    assert asyncio.run(hang_up_then_send()) == [200, 200]
    deadline = time.monotonic() + 10  # the Workers post their stats every 0.5 s
    while (aborted := sum(s["num_aborted"] for s in replica_stats(app.url, AUTH).values())) < aborted_before + 2:
        assert time.monotonic() < deadline, (aborted_before, aborted)
        time.sleep(0.25)


@pytest.mark.ray
def test_the_abandon_probe_sees_a_hang_up_reach_the_worker(app):
    """harness/abandon_probe.py, the figures' tool, on this app: a stream left
    after its first token is aborted on the Worker after a few tokens."""
    [(aborted, decoded)] = abandon_streams(app.url, tries=1, seed=3, headers=AUTH)
    assert aborted == 1 and decoded < 400, (aborted, decoded)
