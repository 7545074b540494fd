"""The HTTP surface (FastAPI): routes, auth, body limits, error bodies.

Routes format requests and responses. A request runs one way: route →
:class:`RequestBuilder` (limits, worker request) → :class:`Dispatcher`
(retries, metrics) → :class:`WorkerClient` (the replicas) → engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from deploy.admission import Admission, AdmissionGuard, charge
from deploy.auth import KeyRing, Tenant, compose_salt, header_bytes, install_keyed_docs
from deploy.dispatch import Dispatcher
from deploy.errors import APIError, error_body, install_error_handlers
from deploy.metrics import IngressMetrics
from deploy.openai_api import OpenAIRoutes
from deploy.protocol import ChatCompletionRequest, CompletionRequest, GenerateBatchRequest, GenerateRequest
from deploy.request_builder import RequestBuilder
from deploy.settings import AppConfig
from deploy.worker_client import WorkerClient
from worker.results import GenerationResult, TokenEvent

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class BodyGuard:
    """ASGI middleware bounding what one request's body may cost the ingress.

    - 413 for a body over ``max_bytes``, declared (``Content-Length``) or
      streamed (chunked);
    - 408 when the whole body has not arrived ``timeout_s`` after the handler
      first asked for it (a stalled or trickling client would otherwise hold
      an ingress slot until the proxy's much longer request timeout).

    Only the body is timed: once it is complete, ``receive`` is used to hear a
    client disconnect and waits as long as the response does. The errors are
    ``HTTPException`` s, so FastAPI's body reader passes them on unchanged.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await _send_error(send, _TooLarge(self.max_bytes))
        loop = asyncio.get_running_loop()
        received, deadline, body_done = 0, None, False

        async def guarded_receive():
            nonlocal received, deadline, body_done
            if body_done:
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _BodyTimeout(self.timeout_s, received) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
                body_done = not message.get("more_body", False)
            return message

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracked_send)
        except (_TooLarge, _BodyTimeout) as error:  # raised outside FastAPI's body reader
            if not started:
                await _send_error(send, error)


class RequestCounter:
    """ASGI middleware: counts each HTTP request by route and the status it
    was answered with (``IngressMetrics.count_request``), read from the
    response's start message; a plain ASGI wrapper, so a stream's messages
    pass straight through (Starlette's ``BaseHTTPMiddleware`` relays every
    one of them through a task and a memory stream)."""

    def __init__(self, app, metrics: IngressMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            if status is not None:
                self.metrics.count_request(scope["path"], status)


class _TooLarge(HTTPException):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is larger than {max_bytes} bytes")


class _BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float, num_received: int) -> None:
        super().__init__(408, f"request body not received within {timeout_s:g} s ({num_received} bytes arrived)")


async def _send_error(send, error: HTTPException) -> None:
    response = JSONResponse(error_body(error.status_code, str(error.detail)), status_code=error.status_code,
                            headers={"Connection": "close"})
    await send({"type": "http.response.start", "status": error.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def build_http_app(config: AppConfig, client: WorkerClient, tokenizer, builder: RequestBuilder,
                   metrics: IngressMetrics | None = None,
                   routing_status: Callable[[], Awaitable[list[dict]]] | None = None) -> FastAPI:
    """The ingress app over ``client``; ``tokenizer`` for the OpenAI routes'
    text; ``builder`` checks prompts against the model's bounds;
    ``routing_status``: what this ingress's request routers read (``/stats``'
    ``routing``; ``router.serve.routing_status`` under Ray)."""
    metrics = metrics or IngressMetrics(model_name=config.model_name if config.vllm_metrics else None)
    dispatcher = Dispatcher(client, metrics, config.router_block_size, config.retry_after_s)
    openai = OpenAIRoutes(config.model_name, tokenizer, builder, dispatcher)
    keyring = KeyRing(config.api_keys, config.cache_namespaces)
    no_docs = dict(docs_url=None, redoc_url=None, openapi_url=None) if keyring.is_enabled else {}
    app = FastAPI(title="kvroute", version="0.1.0", **no_docs)
    install_error_handlers(app)
    app.add_middleware(BodyGuard, max_bytes=config.limits.max_body_bytes, timeout_s=config.body_timeout_s)

    def authorize(request: Request) -> Tenant:
        """The sender's tenant, from the raw ``Authorization`` bytes (401 otherwise)."""
        return keyring.authenticate(header_bytes(request.scope, b"authorization"))

    auth = [Depends(authorize)]
    if keyring.is_enabled:
        install_keyed_docs(app, auth)

    app.add_middleware(RequestCounter, metrics=metrics)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "kvroute", "max_model_len": builder.bounds.max_model_len}
        ]}

    @app.post("/generate")
    async def generate(body: GenerateRequest, x_cache_salt: str | None = Header(default=None),
                       tenant: Tenant = Depends(authorize)):
        token_ids = builder.check_prompt(body.prompt_token_ids, body.max_new_tokens, param="prompt_token_ids")
        params = _token_params(builder, body)
        request = builder.request(token_ids, params, compose_salt(tenant.namespace, body.cache_salt or x_cache_salt))
        if body.stream:
            events = await _primed(dispatcher.stream_lists(request))  # overload before any token: a real 429/503
            return StreamingResponse(_token_events(events), media_type="text/event-stream", headers=_SSE_HEADERS)
        return _generate_output(await dispatcher.run(request), body.logprobs)

    @app.post("/generate_batch")
    async def generate_batch(request: Request, body: GenerateBatchRequest, x_cache_salt: str | None = Header(default=None),
                             tenant: Tenant = Depends(authorize)) -> dict:
        salt = compose_salt(tenant.namespace, body.cache_salt or x_cache_salt)
        if len(body.prompts) > config.limits.max_batch_prompts:
            raise APIError(400, f"{len(body.prompts)} prompts is over the limit of {config.limits.max_batch_prompts}", param="prompts")
        params = _token_params(builder, body)
        items = []
        for index, prompt in enumerate(body.prompts):
            try:
                token_ids = builder.check_prompt(prompt, body.max_new_tokens, param=f"prompts[{index}]")
                items.append(builder.request(token_ids, params, salt))
            except APIError as error:
                items.append(error)
        charge(request.scope, max(1, sum(not isinstance(item, APIError) for item in items)))  # its fan-out
        outputs = await dispatcher.run_batch(items)
        return {"outputs": [o.body() if isinstance(o, APIError) else _generate_output(o, body.logprobs) for o in outputs]}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest, x_cache_salt: str | None = Header(default=None),
                          tenant: Tenant = Depends(authorize)):
        pairs = openai.completion_requests(body, x_cache_salt, tenant.namespace)
        charge(request.scope, len(pairs))  # prompts × n choices
        with_logprobs = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            deltas = await _primed(openai.deltas(pairs))
            return StreamingResponse(openai.sse(pairs, deltas, False, include_usage, with_logprobs), media_type="text/event-stream", headers=_SSE_HEADERS)
        states = await openai.collect(pairs)
        return openai.completion_body(states, pairs, int(time.time()), f"cmpl-{uuid.uuid4().hex}", with_logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest, x_cache_salt: str | None = Header(default=None),
                               tenant: Tenant = Depends(authorize)):
        pairs = openai.chat_requests(body, x_cache_salt, tenant.namespace)
        charge(request.scope, len(pairs))  # n choices
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            deltas = await _primed(openai.deltas(pairs))
            return StreamingResponse(openai.sse(pairs, deltas, True, include_usage, body.logprobs), media_type="text/event-stream", headers=_SSE_HEADERS)
        states = await openai.collect(pairs)
        return openai.chat_body(states, pairs, int(time.time()), f"chatcmpl-{uuid.uuid4().hex}", body.logprobs)

    @app.get("/stats", dependencies=auth)
    async def stats() -> dict:
        replicas = await client.stats()
        totals = {}
        for replica_stats in replicas.values():
            for key in ("hits", "misses", "tokens_saved", "prefill_tokens", "cache_num_tokens", "decode_tokens"):
                totals[key] = totals.get(key, 0) + replica_stats.engine.get(key, 0)
        lookups = totals.get("hits", 0) + totals.get("misses", 0)
        totals["hit_rate"] = totals.get("hits", 0) / lookups if lookups else 0.0
        return {"model": config.model_name, "router": config.router,
                "replicas": {replica_id: s.to_dict() for replica_id, s in replicas.items()}, "totals": totals,
                "routing": await routing_status() if routing_status is not None else []}

    @app.get("/metrics", dependencies=auth if config.metrics_require_key else [])
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(await client.stats()), media_type="text/plain; version=0.0.4")

    metrics.route_templates = frozenset(route.path for route in app.routes)  # every other path: "unmatched"
    admission = Admission(config.max_in_flight_per_worker)

    async def count_workers() -> int:
        return len(await client.stats())

    app.add_middleware(AdmissionGuard, admission=admission, retry_after_s=config.retry_after_s,  # outermost
                       count_workers=count_workers,
                       on_refused=lambda: metrics.rejected.labels(reason="ingress_admission").inc())
    return app


def _token_params(builder: RequestBuilder, body):
    return builder.sampling(
        max_new_tokens=body.max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop_token_ids=builder.check_stop_token_ids(body.stop_token_ids),
        logprobs=body.logprobs,
        ignore_eos=body.ignore_eos,
    )


def _generate_output(result: GenerationResult, with_logprobs: bool) -> dict:
    output = {
        "token_ids": list(result.token_ids),
        "replica_id": result.replica_id,
        "cached_tokens": result.cached_tokens,
        "prompt_tokens": result.prompt_tokens,
        "finish_reason": result.finish_reason,
    }
    if with_logprobs:
        output["logprobs"] = None if result.logprobs is None else list(result.logprobs)
    return output


async def _primed(items: AsyncIterator) -> AsyncIterator:
    """``items`` with its first element already awaited, so that a failure
    before any output (a full queue, no replica) raises here and becomes an
    HTTP status with ``Retry-After`` instead of an error event after a 200."""
    try:
        first = await anext(items)
    except BaseException:
        await items.aclose()
        raise

    async def replay():
        try:
            yield first
            async for item in items:
                yield item
        finally:
            await items.aclose()

    return replay()


async def _token_events(lists: AsyncIterator[list[TokenEvent | GenerationResult]]):
    """SSE for ``/generate`` with ``stream: true``: one event per token, then
    the summary; the events of tokens that arrived together in one message."""
    try:
        async for items in lists:
            yield "".join(f"data: {json.dumps({**item.to_dict(), 'replica_id': item.replica_id})}\n\n" for item in items)
    except APIError as error:
        yield error.sse_event()
    except asyncio.CancelledError:
        raise
    yield "data: [DONE]\n\n"
