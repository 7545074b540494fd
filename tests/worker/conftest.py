"""Fixtures for the worker tests: small engines on the built-in tiny-llama,
random byte prompts."""

from __future__ import annotations

import random

import pytest

from worker import AsyncEngine, Engine, EngineConfig

SMALL = dict(
    cache_budget_tokens=2048,
    kv_pool_tokens=8192,
    max_batch_tokens=256,
    max_num_seqs=16,
    max_model_len=1024,
)


def small_config(**overrides) -> EngineConfig:
    return EngineConfig(**{"deterministic": True, **SMALL, **overrides})


@pytest.fixture
def make_engine():
    """``make_engine(**overrides)``: a deterministic tiny-llama engine unless told otherwise."""

    def build(**overrides) -> Engine:
        return Engine(small_config(**overrides))

    return build


@pytest.fixture
def make_async_engine():
    """``make_async_engine(**overrides)``: the same, behind the asyncio interface."""

    def build(**overrides) -> AsyncEngine:
        return AsyncEngine(small_config(**overrides))

    return build


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


@pytest.fixture
def tokens(rng):
    """``tokens(n)``: ``n`` random byte tokens (never pad, eos or unk)."""

    def draw(count: int) -> list[int]:
        return [rng.randrange(3, 259) for _ in range(count)]

    return draw
