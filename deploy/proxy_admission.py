"""kvroute's admission inside Ray Serve's HTTP proxy: overload is refused
with the same OpenAI-style JSON 429 + ``Retry-After`` as the Ingress's own
admission (deploy/admission.py), but before the proxy's Ray call to the
Ingress replica.

Serve's Python proxy wraps its ASGI app in the Starlette middlewares that
the function named by ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` returns
(Ray 2.60; read by every proxy when it starts, so it is set in the
environment of ``serve run`` or of ``ray start`` on every node, like
PYTHONPATH to this repository). :func:`middlewares` is that function. From
the environment:

- ``KVROUTE_PROXY_MAX_IN_FLIGHT``: generation requests (``POST`` to the four
  generation routes) this proxy lets through at once; the next one is
  refused on the spot. Unset or 0: nothing is installed.
- ``KVROUTE_PROXY_RETRY_AFTER_S``: the refusals' ``Retry-After`` (default 1).

Each proxy counts its own (``proxy_location: EveryNode`` runs one per node);
a request counts from its arrival until its response (a stream: its last
chunk) has left, whatever the outcome. Other routes (``/health``,
``/metrics``, ``/stats``, ``/v1/models``) are never counted or refused.
Refusals carry ``x-kvroute-refused-by: proxy`` and are counted in Ray's
metric ``kvroute_proxy_refused_total``.

Set the limit at or below what the Ingress admits (``max_in_flight_per_worker``
× Workers, per Ingress replica), so the proxy is the one that refuses: a
refusal then costs the proxy's HTTP parsing and this check, not a Ray call,
the Ingress replica's request handling and its reply (RELIABILITY.md,
"Admission in Serve's proxy"). The Ingress's admission stays as it was: it
still weighs a request's fan-out, which the proxy does not read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from deploy.admission import GENERATION_PATHS, Admission, Refusal

logger = logging.getLogger("kvroute.proxy_admission")

MAX_IN_FLIGHT_ENV = "KVROUTE_PROXY_MAX_IN_FLIGHT"
RETRY_AFTER_ENV = "KVROUTE_PROXY_RETRY_AFTER_S"
CALLBACK = "deploy.proxy_admission:middlewares"  # the value of RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
REFUSED_BY = (b"x-kvroute-refused-by", b"proxy")


class ProxyAdmission:
    """ASGI middleware: at most ``max_in_flight`` generation requests through
    at once; the rest get :class:`~deploy.admission.Refusal` before anything
    else runs (the body is not read). Invariant: ``admission.num_in_flight``
    = the generation requests inside ``app`` now (an exception or a client
    that went away releases its place like a response does)."""

    def __init__(self, app, max_in_flight: int, retry_after_s: int = 1,
                 on_refused: Callable[[], None] | None = None) -> None:
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if type(retry_after_s) is not int or retry_after_s < 1:
            raise ValueError(f"retry_after_s must be an int >= 1, got {retry_after_s!r}")
        self.app = app
        self.admission = Admission(max_in_flight)
        self.on_refused = on_refused
        self._refusal = Refusal(retry_after_s, counted="requests", extra_headers=(REFUSED_BY,))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        ticket = self.admission.try_admit()
        if ticket is None:
            if self.on_refused is not None:
                self.on_refused()
            return await self._refusal.send(send, self.admission.limit)
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release(ticket)


def environment(max_in_flight: int, retry_after_s: int = 1) -> dict[str, str]:
    """The variables that turn it on, for the environment of ``serve run`` /
    ``ray start`` (with the repository on PYTHONPATH)."""
    return {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK, MAX_IN_FLIGHT_ENV: str(max_in_flight),
            RETRY_AFTER_ENV: str(retry_after_s)}


def settings_from_env(environ=os.environ) -> tuple[int, int]:
    """``(max_in_flight, retry_after_s)`` from the environment (0: off);
    ValueError naming the variable for anything but a non-negative int
    (a Retry-After of at least 1)."""
    def read(name: str, default: int, least: int) -> int:
        text = environ.get(name, "").strip()
        if not text:
            return default
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {text!r}") from None
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
        return value
    return read(MAX_IN_FLIGHT_ENV, 0, 0), read(RETRY_AFTER_ENV, 1, 1)


def _refusal_counter() -> Callable[[], None] | None:
    """``kvroute_proxy_refused_total``'s inc, or None where Ray's metrics are unavailable."""
    try:
        from ray.util.metrics import Counter

        counter = Counter("kvroute_proxy_refused_total",
                          description="Generation requests Serve's proxy refused (kvroute admission, 429)")
        return counter.inc
    except Exception:  # noqa: BLE001 - a proxy without Ray's metrics still refuses
        return None


def middlewares() -> list:
    """The proxy callback: ``[Middleware(ProxyAdmission, ...)]`` when
    ``KVROUTE_PROXY_MAX_IN_FLIGHT`` is set above 0, else ``[]``."""
    from starlette.middleware import Middleware

    max_in_flight, retry_after_s = settings_from_env()
    if max_in_flight == 0:
        return []
    logger.info("proxy admission: %d generation requests in flight, Retry-After %d s", max_in_flight, retry_after_s)
    return [Middleware(ProxyAdmission, max_in_flight=max_in_flight, retry_after_s=retry_after_s,
                       on_refused=_refusal_counter())]
