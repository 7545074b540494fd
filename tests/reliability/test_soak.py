"""A short soak (the CI version of ``python -m harness.soak``, whose 5-minute
figures are in RELIABILITY.md): mixed valid, invalid, streamed and cancelled
traffic with API keys, at a rate the two CPU replicas sustain. Nothing lost,
nothing >= 500 but overload 503s with Retry-After, memory flat, audits clean."""

from __future__ import annotations

import asyncio

import pytest

from harness.soak import soak
from tests.reliability.conftest import API_KEY

pytestmark = pytest.mark.ray


def test_short_soak_of_mixed_traffic_loses_nothing_and_leaves_clean_replicas(core_app):
    figures = asyncio.run(soak(core_app, duration_s=40.0, rate_rps=6.0, sample_s=10.0,
                               keys=(API_KEY, "sk-reliability-2")))
    print("FIGURES soak (40 s):", {k: v for k, v in figures.items() if k != "rss_growth_mib"})
    assert figures["num_requests"] >= 200, figures
    assert figures["num_lost"] == 0, figures["lost"]
    assert figures["unexpected"] == [], figures["unexpected"]
    assert all(figures["audits_clean"]) and len(figures["audits_clean"]) == 2, figures
    assert figures["max_rss_growth_mib"] < 64, figures["rss_growth_mib"]
