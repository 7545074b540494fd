"""A live app for the integration tests, brought up the way the README does:
``ray start --head``, ``serve run --non-blocking deploy/config.yaml``, then
``serve shutdown -y`` and stopping the Ray processes this run started."""

from __future__ import annotations

import pytest

from harness.serving import config_engine_args, start_app


@pytest.fixture(scope="module")
def live_app():
    # Deterministic engines make outputs comparable bit for bit across
    # replicas, batches and cache hits; everything else is the README's config.
    app = start_app(args_overrides={"engine": config_engine_args(deterministic=True)})
    yield app
    app.__exit__(None, None, None)
