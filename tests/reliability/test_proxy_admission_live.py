"""kvroute's admission inside Serve's Python proxy (deploy/proxy_admission.py),
live: with ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` set for the cluster
and no limit of its own, the proxy on the app's own port learns the
Ingress's limit from its responses and from then on refuses the generation
requests beyond it with kvroute's JSON 429 + ``Retry-After`` itself,
without calling the Ingress for them: every 429 of a burst is the proxy's
but for its probes (one per ``PROBE_PERIOD_S`` goes on to the Ingress).
A client that abandons a stream gives its place back.

Fails without the callback: the 429s would be the Ingress's (no
``x-kvroute-refused-by: proxy``), and its announcement would reach clients."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from deploy.proxy_admission import environment
from harness.serving import ServeApp
from tests.reliability.conftest import ADMIT_TWO_ARGS, AUTH, assert_burst_is_served_or_refused_as_json, post_with_key

PROXY_LIMIT = 2  # what ADMIT_TWO_ARGS's Ingress admits with 2 Workers


@pytest.fixture(scope="module")
def app(exclusive):
    # the Ingress admits 1 per Worker: 2; the proxy follows it
    app = ServeApp(num_cpus=2, cluster_env=environment(), args_overrides=ADMIT_TWO_ARGS)
    with app:
        app.deploy()
        yield app


def finished_requests(app) -> int:
    """Requests the Workers finished, once their posted stats stop changing."""
    def read() -> int:
        stats = httpx.get(f"{app.url}/stats", headers=AUTH, timeout=30, trust_env=False).json()
        return sum(replica["num_finished"] for replica in stats["replicas"].values())
    last = read()
    for _ in range(20):
        time.sleep(1.0)  # > stats_period_s: each Worker posts again
        now = read()
        if now == last:
            return now
        last = now
    return last


@pytest.mark.ray
def test_the_proxy_refuses_the_excess_with_kvroutes_json_before_the_ingress(app):
    short = {"prompt_token_ids": [40, 41], "max_new_tokens": 2, "ignore_eos": True}
    for _ in range(60):  # the Ingress announces its limit once it has counted both Workers (their stats)
        if len(httpx.get(f"{app.url}/stats", headers=AUTH, timeout=30, trust_env=False).json()["replicas"]) == 2:
            break
        time.sleep(0.5)
    time.sleep(0.5)  # past the Ingress's start-up recount period
    for _ in range(2):  # the answers tell the proxy the Ingress's limit
        answer = post_with_key(f"{app.url}/generate", short)
        assert answer.status_code == 200 and "x-kvroute-admission-limit" not in answer.headers
    before = finished_requests(app)
    statuses = assert_burst_is_served_or_refused_as_json(app.url, count=12)
    print("FIGURES proxy admission burst:", statuses)
    assert statuses.count(200) >= PROXY_LIMIT
    body = {"prompt_token_ids": [50, 51, 52], "max_new_tokens": 48, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{app.url}/v1/completions", headers=AUTH,
                                                      json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 48,
                                                            "ignore_eos": True})
                                          for _ in range(8)))

    refused = [r for r in asyncio.run(burst()) if r.status_code == 429]
    by_proxy = [r for r in refused if r.headers.get("x-kvroute-refused-by") == "proxy"]
    # all but the probes: past the limit one request per PROBE_PERIOD_S goes on, and the Ingress may refuse it
    assert by_proxy and len(refused) - len(by_proxy) <= 2, [dict(r.headers) for r in refused]
    # the refusals never reached a Worker: only the admitted requests were generated
    generated = finished_requests(app) - before
    assert generated == statuses.count(200) + 1 + (8 - len(refused)), (generated, statuses, len(refused))
    for path in ("/health", "/v1/models", "/stats", "/metrics"):  # never counted, never refused
        assert httpx.get(f"{app.url}{path}", headers=AUTH, timeout=30, trust_env=False).status_code == 200


@pytest.mark.ray
def test_an_abandoned_stream_gives_its_place_back(app):
    body = {"prompt_token_ids": [60, 61, 62], "max_new_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(trust_env=False, timeout=60) as client:
        for _ in range(PROXY_LIMIT + 1):  # more streams than places, each left after its first event
            with client.stream("POST", f"{app.url}/generate", json=body, headers=AUTH) as response:
                assert response.status_code == 200
                next(response.iter_lines())
    # every place is free again: PROXY_LIMIT requests at once are all admitted
    short = {"prompt_token_ids": [70, 71], "max_new_tokens": 2, "ignore_eos": True}

    async def together() -> list[int]:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            responses = await asyncio.gather(*(client.post(f"{app.url}/generate", json=short, headers=AUTH)
                                               for _ in range(PROXY_LIMIT)))
        return [r.status_code for r in responses]

    for _ in range(20):  # the proxy sees each disconnect within moments
        if asyncio.run(together()) == [200] * PROXY_LIMIT:
            break
        asyncio.run(asyncio.sleep(0.25))
    else:
        pytest.fail("an abandoned stream kept its place in the proxy's admission")
    assert post_with_key(f"{app.url}/generate", short).status_code == 200
