"""The ingress's own admission: a counter of generation requests in flight,
checked before anything else runs, so overload is refused at once, cheaply,
as OpenAI-style JSON with ``Retry-After``.

Without it the excess waits in Serve's queues until one is full and Serve's
proxy answers a plain-text 503 — after the request has already cost a queue
slot, a wait and a timeout. With it, the deployments' Serve limits are set
above what admission lets through (deploy/config.yaml), so Serve's own limit
is not the one that trips.

The limit is ``max_in_flight_per_worker`` × the number of live Worker
replicas (refreshed from the stats board every few seconds; 1 until the first
read). A request counts once whatever it fans out to (``n`` choices, batch
prompts): the engines' bounded queues (429) still bound those. Each ingress
replica counts its own requests: with R ingress replicas the cluster admits
up to R × the limit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from deploy.errors import error_body

GENERATION_PATHS = frozenset({"/generate", "/generate_batch", "/v1/completions", "/v1/chat/completions"})


class Admission:
    """In-flight counting. Invariant: ``0 <= num_in_flight``; a request
    :meth:`try_admit` admitted is :meth:`release` d exactly once."""

    def __init__(self, max_in_flight_per_worker: int, num_workers: int = 1) -> None:
        if max_in_flight_per_worker < 0:
            raise ValueError(f"max_in_flight_per_worker must be >= 0, got {max_in_flight_per_worker}")
        self.max_in_flight_per_worker = max_in_flight_per_worker
        self.num_workers = max(1, num_workers)
        self.num_in_flight = 0
        self.num_refused = 0

    @property
    def is_enabled(self) -> bool:
        return self.max_in_flight_per_worker > 0

    @property
    def limit(self) -> int:
        return self.max_in_flight_per_worker * self.num_workers

    def set_num_workers(self, num_workers: int) -> None:
        self.num_workers = max(1, num_workers)

    def try_admit(self) -> bool:
        if self.is_enabled and self.num_in_flight >= self.limit:
            self.num_refused += 1
            return False
        self.num_in_flight += 1
        return True

    def release(self) -> None:
        assert self.num_in_flight > 0, "release without admit"
        self.num_in_flight -= 1


class AdmissionGuard:
    """ASGI middleware: generation requests beyond :class:`Admission`'s limit
    get 429 ``engine_overloaded``-style JSON with ``Retry-After`` before their
    body is read. ``count_workers``: async () -> live Worker replicas."""

    def __init__(self, app, admission: Admission, retry_after_s: int,
                 count_workers: Callable[[], Awaitable[int]] | None = None, refresh_period_s: float = 2.0,
                 on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.admission = admission
        self.count_workers = count_workers
        self.refresh_period_s = refresh_period_s
        self.on_refused = on_refused
        body = error_body(429, f"server busy: more than {{limit}} requests in flight; retry after {retry_after_s} s",
                          code="overloaded")
        self._body_template = json.dumps(body)
        self._headers = [(b"content-type", b"application/json"), (b"retry-after", str(retry_after_s).encode())]
        self._next_refresh_s = 0.0
        self._refreshing: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self._maybe_refresh()
        if scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if not self.admission.try_admit():
            if self.on_refused:
                self.on_refused()
            body = self._body_template.replace("{limit}", str(self.admission.limit)).encode()
            await send({"type": "http.response.start", "status": 429,
                        "headers": self._headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release()

    def _maybe_refresh(self) -> None:
        if self.count_workers is None or (self._refreshing and not self._refreshing.done()):
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_refresh_s:
            return
        self._next_refresh_s = loop.time() + self.refresh_period_s

        async def refresh():
            try:
                self.admission.set_num_workers(await self.count_workers())
            except Exception:  # noqa: BLE001 - keep the last count; the next refresh tries again
                pass

        self._refreshing = loop.create_task(refresh())
