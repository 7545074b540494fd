"""Two ways to serve the app in tests.

- ``serve_in_process(**app_args)``: the real FastAPI app over one real
  engine in this process (deterministic tiny-llama, built once per session)
  through ``harness.engine_client.EngineClient`` (streams in lists spaced by
  the config's ``stream_interval_ms``, as the Worker sends them); no Ray,
  milliseconds a route.
- ``live_app``: the app brought up the way the README does (``ray start
  --head``, ``serve run --non-blocking deploy/config.yaml``, then ``serve
  shutdown -y`` and stopping the Ray processes this run started)."""

from __future__ import annotations

import pytest

from harness.serving import config_engine_args, start_app

IN_PROCESS_ENGINE = dict(deterministic=True, cache_budget_tokens=4096, kv_pool_tokens=8192, max_batch_tokens=256,
                         max_num_seqs=16, max_model_len=1024)


@pytest.fixture(scope="session")
def engine():
    from worker import AsyncEngine, EngineConfig

    engine = AsyncEngine(EngineConfig(**IN_PROCESS_ENGINE))
    yield engine
    engine._closed = True  # noqa: SLF001 - the thread is a daemon; stop it without a loop
    engine._wakeup.set()  # noqa: SLF001
    engine._thread.join(timeout=30)  # noqa: SLF001 - gone before the interpreter exits


@pytest.fixture(scope="session")
def serve_in_process(engine):
    """``serve_in_process(**app_args)``: a TestClient of the ingress app as
    ``build_app`` makes it (``AppConfig(**app_args)``), over the session's engine."""
    from fastapi.testclient import TestClient

    from deploy.http_app import build_http_app
    from deploy.request_builder import ModelBounds, RequestBuilder
    from deploy.settings import AppConfig
    from harness.engine_client import EngineClient
    from worker.model import load_tokenizer

    def serve(**app_args) -> TestClient:
        config = AppConfig(engine=IN_PROCESS_ENGINE, **app_args)
        builder = RequestBuilder(config.limits, ModelBounds.from_info(engine.model_info()), config.router_block_size)
        client = EngineClient(engine, stream_interval_s=config.stream_interval_ms / 1000)  # as the Ray client
        app = build_http_app(config, client, load_tokenizer(config.model), builder)
        return TestClient(app, raise_server_exceptions=False)

    return serve


@pytest.fixture(scope="module")
def live_app():
    # Deterministic engines make outputs comparable bit for bit across
    # replicas, batches and cache hits; everything else is the README's config.
    app = start_app(args_overrides={"engine": config_engine_args(deterministic=True)})
    yield app
    app.__exit__(None, None, None)
