"""Cold prefix groups, live, on a fresh 2-replica app (this module's own).

The router places a cold prefix by ring order plus a balance term on each
replica's recent work: on replicas with equal (empty) histories, new groups
spread over both and then stick to their home. A module of its own, so the
other live tests' work (which leaves one replica with more recent work, and
so draws every cold group to the other) does not decide where they go."""

from __future__ import annotations

import random

import httpx
import pytest

pytestmark = pytest.mark.ray


def post(app, path, body):
    return httpx.post(app.url + path, json=body, timeout=120, trust_env=False)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


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
