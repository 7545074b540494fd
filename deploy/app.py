"""``serve run deploy/config.yaml`` builds the application here.

Ingress (FastAPI) → Worker handle whose request router is chosen by the
config (ours: ``router/serve.py``) → Worker replicas, each with an engine.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from deploy.http_app import build_http_app
from deploy.ray_client import RayWorkerClient
from deploy.request_builder import ModelBounds, RequestBuilder
from deploy.settings import ROUTERS, AppConfig
from router.policy_config import PolicyConfig
from router.serve import routing_status
from worker import EngineConfig
from worker.config import FetchConfig
from worker.model import load_tokenizer, model_info
from worker.replica import Worker


@serve.deployment(name="Ingress", max_ongoing_requests=1024)
@serve.ingress()
class Ingress:
    def __init__(self, worker_handle, config: AppConfig) -> None:
        app_name = serve.get_replica_context().app_name
        self._client = RayWorkerClient(worker_handle, app_name, config.retry_after_s, 3 * config.stats_period_s + 2,
                                       config.stream_interval_ms / 1000)
        self._builder = RequestBuilder(config.limits, ModelBounds.from_info(model_info(config.model, config.engine)),
                                       config.router_block_size)
        self._tokenizer = load_tokenizer(config.model)
        self._config = config

    def __serve_build_asgi_app__(self):
        return build_http_app(self._config, self._client, self._tokenizer, self._builder,
                              routing_status=routing_status)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application for ``args`` (the config file's ``args`` block)."""
    config = AppConfig.from_args(args)
    engine_config = EngineConfig(model=config.model, **config.engine)
    fetch_config = FetchConfig(enabled=config.fetch_enabled, timeout_s=config.fetch_timeout_s,
                               min_speedup=config.fetch_min_speedup, prior_overhead_s=config.fetch_prior_overhead_s,
                               patience=config.fetch_patience, prefill_patience=config.fetch_prefill_patience)
    router_kwargs = checked_router_kwargs(config)
    if config.router_class_path == ROUTERS["kvroute"]:  # the adapter's own kwarg (router/serve.py)
        router_kwargs["share_decisions_period_s"] = config.share_decisions_period_s
    worker = Worker.options(
        request_router_config=RequestRouterConfig(
            request_router_class=config.router_class_path,
            request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=config.routing_stats_period_s,
        ),
    ).bind(engine_config, config.router_block_size, config.stats_period_s, fetch_config, config.summary_mode)
    return Ingress.bind(worker, config)


def checked_router_kwargs(config: AppConfig) -> dict:
    """The request router's kwargs. For ours, its ``PolicyConfig`` is built
    here, so an unknown key, a bad value or a routing block size other than
    ``router_block_size`` fails the app's start-up, not its first request.
    Its ``fetch_enabled`` is the app's (the workers follow the same switch)."""
    kwargs = dict(config.router_kwargs)
    if config.router_class_path != ROUTERS["kvroute"]:
        return kwargs
    kwargs.setdefault("block_size", config.router_block_size)
    if kwargs["block_size"] != config.router_block_size:
        raise ValueError(f"router_kwargs.block_size {kwargs['block_size']!r} differs from router_block_size "
                         f"{config.router_block_size}: the ingress and the workers hash blocks of router_block_size")
    kwargs.setdefault("fetch_enabled", config.fetch_enabled)
    if kwargs["fetch_enabled"] != config.fetch_enabled:
        raise ValueError(f"router_kwargs.fetch_enabled {kwargs['fetch_enabled']!r} differs from fetch_enabled "
                         f"{config.fetch_enabled}: set fetch_enabled once, for the router and the workers")
    known = {f.name for f in fields(PolicyConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown router_kwargs {unknown} for the kvroute router; known: {sorted(known)}")
    PolicyConfig(**kwargs)  # ValueError naming a bad value
    return kwargs
