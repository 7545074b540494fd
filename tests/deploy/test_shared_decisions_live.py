"""Two Ingress replicas, each with its own request router, sharing their
decisions through the app's decision board (``router.serve_decisions``),
live: each books the other's, and a prompt's continuation finds the replica
the other Ingress sent the prompt to, with the Workers' summaries too rare
to have told it (one every 30 s)."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from harness.serving import start_app

pytestmark = pytest.mark.ray

NUM_PROMPTS = 12


@pytest.fixture(scope="module")
def two_ingress_app():
    app = start_app(args_overrides={"routing_stats_period_s": 30.0},
                    deployment_overrides={"Ingress": {"num_replicas": 2}})
    yield app
    app.__exit__(None, None, None)


def every_router(app) -> dict:
    routers = {}
    for _ in range(16):  # the proxy spreads the reads over both Ingress replicas
        for router in httpx.get(app.url + "/stats", trust_env=False, timeout=10).json()["routing"]:
            routers[router["in_replica"]] = router
    return routers


def generate(app, prompt):
    response = httpx.post(app.url + "/generate", json={"prompt_token_ids": prompt, "max_new_tokens": 2},
                          timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def test_each_router_books_the_others_decisions_and_routes_continuations_there(two_ingress_app):
    rng = random.Random(5)
    prompts = [[rng.randrange(32, 127) for _ in range(200)] for _ in range(NUM_PROMPTS)]
    homes = [generate(two_ingress_app, prompt)["replica_id"] for prompt in prompts]
    deadline = time.time() + 20
    while True:  # a lone router exchanges once a second until it hears another
        routers = every_router(two_ingress_app)
        shared = [r.get("shared_decisions", {}) for r in routers.values()]
        # Serve calls a router's on_request_completed from its own loop, after the response may have
        # reached the client: the last request can still be in flight there for a moment
        if (len(routers) == 2 and sum(s.get("sent", 0) for s in shared) >= NUM_PROMPTS
                and sum(s.get("booked", 0) for s in shared) >= NUM_PROMPTS
                and all(r.get("in_flight") == 0 for r in routers.values())) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(routers) == 2, "both Ingress replicas answer /stats"
    (a, b) = routers.values()
    assert a["shared_decisions"]["sent"] + b["shared_decisions"]["sent"] == NUM_PROMPTS  # each routed by one
    assert a["shared_decisions"]["booked"] == b["shared_decisions"]["sent"]
    assert b["shared_decisions"]["booked"] == a["shared_decisions"]["sent"]
    assert a["peer_decisions"] == a["shared_decisions"]["booked"] and a["in_flight"] == 0
    for prompt, home in zip(prompts, homes):  # whichever Ingress takes it knows where the prompt went
        follow_up = generate(two_ingress_app, prompt + [rng.randrange(32, 127) for _ in range(40)])
        assert follow_up["replica_id"] == home
        assert follow_up["cached_tokens"] >= len(prompt) - 1
