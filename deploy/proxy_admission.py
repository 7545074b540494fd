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
  refused on the spot. Unset or ``auto`` (the default): the sum of the
  limits the Ingress replicas announce on their generation responses
  (``x-kvroute-admission-limit``, taken off before the client sees it), so
  the proxy follows the live Workers as the Ingress does; before the first
  announcement it refuses nothing. A number: that limit, fixed. 0: nothing
  is installed.
- ``KVROUTE_PROXY_RETRY_AFTER_S``: the refusals' ``Retry-After`` (default 1).

Each proxy counts its own (``proxy_location: EveryNode`` runs one per node);
a request counts from its arrival until its response (a stream: its last
chunk) has left, whatever the outcome. Other routes (``/health``,
``/metrics``, ``/stats``, ``/v1/models``) are never counted or refused.
Refusals carry ``x-kvroute-refused-by: proxy`` and are counted in Ray's
metric ``kvroute_proxy_refused_total``.

A fixed limit belongs at or below what the Ingress admits
(``max_in_flight_per_worker`` × Workers, per Ingress replica), so the proxy
is the one that refuses: a refusal then costs the proxy's HTTP parsing and
this check, not a Ray call, the Ingress replica's request handling and its
reply (RELIABILITY.md, "Admission in Serve's proxy"). Following the Ingress
gives exactly that, and with several nodes each proxy lets through up to
the whole sum (the Ingress refuses what is over). The Ingress's admission
stays as it was: it still weighs a request's fan-out, which the proxy does
not read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from deploy.admission import GENERATION_PATHS, LIMIT_HEADER, Admission, Refusal

logger = logging.getLogger("kvroute.proxy_admission")

MAX_IN_FLIGHT_ENV = "KVROUTE_PROXY_MAX_IN_FLIGHT"
RETRY_AFTER_ENV = "KVROUTE_PROXY_RETRY_AFTER_S"
CALLBACK = "deploy.proxy_admission:middlewares"  # the value of RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
REFUSED_BY = (b"x-kvroute-refused-by", b"proxy")
AUTO = "auto"  # KVROUTE_PROXY_MAX_IN_FLIGHT: follow the Ingress replicas' announced limits (also when unset)
LEARN_WINDOW_S = 30.0  # an Ingress replica not heard from for this long no longer adds to the limit
# Following the Ingress, at most one request per this period goes on past the limit: the limit heard is
# the Ingress's as of its last count of live Workers (up to its refresh period old), and the Ingress
# recounts before it refuses, which the proxy cannot. The probe lets it; under a flood that is at most
# 1 / PROBE_PERIOD_S refusals a second made by the Ingress instead of the proxy.
PROBE_PERIOD_S = 0.25


class ProxyAdmission:
    """ASGI middleware: at most a limit of generation requests through at
    once; the rest get :class:`~deploy.admission.Refusal` before anything
    else runs (the body is not read). The limit is ``max_in_flight``, or,
    with None, what the Ingress replicas announce on their generation
    responses (:data:`~deploy.admission.LIMIT_HEADER`: each replica's token
    and limit): the sum over the replicas heard from in the last
    ``learn_window_s``; none heard yet, or one whose admission is off:
    no limit (the Ingress's own admission still holds); over it, one request
    per ``PROBE_PERIOD_S`` goes on to the Ingress, which recounts its Workers
    before refusing (a limit heard before Workers were added would otherwise
    hold until the Ingress's next periodic count). The header is taken off
    the response either way. Invariant: ``admission.num_in_flight``
    = the generation requests inside ``app`` now (an exception or a client
    that went away releases its place like a response does)."""

    def __init__(self, app, max_in_flight: int | None = None, retry_after_s: int = 1,
                 on_refused: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 learn_window_s: float = LEARN_WINDOW_S) -> None:
        if max_in_flight is not None and (type(max_in_flight) is not int or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be None (follow the Ingress) or an int >= 1, got {max_in_flight!r}")
        if type(retry_after_s) is not int or retry_after_s < 1:
            raise ValueError(f"retry_after_s must be an int >= 1, got {retry_after_s!r}")
        self.app = app
        self.learns = max_in_flight is None
        self.admission = Admission(max_in_flight or 0)  # 0: no limit (yet)
        self.on_refused = on_refused
        self.clock = clock
        self.learn_window_s = learn_window_s
        self._heard: dict[bytes, tuple[int, float]] = {}  # Ingress replica's token -> (limit, when announced)
        self._next_expiry_s = 0.0
        self._next_probe_s = 0.0
        self._refusal = Refusal(retry_after_s, counted="requests", extra_headers=(REFUSED_BY,))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.learns and self.clock() >= self._next_expiry_s:
            self._set_limit()
        ticket = self.admission.try_admit()
        if ticket is None and self.learns and (now := self.clock()) >= self._next_probe_s:
            self._next_probe_s = now + PROBE_PERIOD_S
            ticket = self.admission.admit_over_limit()  # the Ingress recounts its Workers; its answer brings news
        if ticket is None:
            if self.on_refused is not None:
                self.on_refused()
            return await self._refusal.send(send, self.admission.limit)

        async def send_reading_the_limit(message):
            if message["type"] == "http.response.start":
                kept, heard = [], []
                for header in message.get("headers") or ():
                    (heard if header[0] == LIMIT_HEADER else kept).append(header)
                if heard:
                    if self.learns:
                        for _, value in heard:
                            self.hear(value)
                    message = {**message, "headers": kept}
            await send(message)
        try:
            await self.app(scope, receive, send_reading_the_limit)
        finally:
            self.admission.release(ticket)

    def hear(self, value: bytes) -> None:
        """One announcement, ``b"<token> <limit>"`` (anything else is ignored)."""
        token, _, limit_text = bytes(value).partition(b" ")
        try:
            limit = int(limit_text)
        except ValueError:
            return
        if limit < 0:
            return
        previous = self._heard.get(token)
        self._heard[token] = (limit, self.clock())
        if previous is None or previous[0] != limit:
            self._set_limit()

    @property
    def limit(self) -> int | None:
        """The limit in force now; None: none."""
        return self.admission.limit if self.admission.is_enabled else None

    def _set_limit(self) -> None:
        """Forget replicas not heard from within the window, then sum the rest."""
        now = self.clock()
        self._heard = {t: (limit, at) for t, (limit, at) in self._heard.items() if now - at <= self.learn_window_s}
        limits = [limit for limit, _ in self._heard.values()]
        self.admission.max_in_flight_per_worker = 0 if not limits or 0 in limits else sum(limits)
        self._next_expiry_s = now + self.learn_window_s / 4


def environment(max_in_flight: int | None = None, retry_after_s: int = 1) -> dict[str, str]:
    """The variables that turn it on, for the environment of ``serve run`` /
    ``ray start`` (with the repository on PYTHONPATH); ``max_in_flight``
    None: follow the Ingress's limit."""
    return {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK,
            MAX_IN_FLIGHT_ENV: AUTO if max_in_flight is None else str(max_in_flight),
            RETRY_AFTER_ENV: str(retry_after_s)}


def settings_from_env(environ=os.environ) -> tuple[int | None, int]:
    """``(max_in_flight, retry_after_s)`` from the environment:
    ``max_in_flight`` None (unset or "auto": follow the Ingress), 0 (off) or
    the fixed limit; ValueError naming the variable for anything else (a
    Retry-After must be an int >= 1)."""
    def read(name: str, default: int | None, least: int) -> int | None:
        text = environ.get(name, "").strip()
        if not text or (default is None and text == AUTO):
            return default
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer{' or ' + repr(AUTO) if default is None else ''}, "
                             f"got {text!r}") from None
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
        return value
    return read(MAX_IN_FLIGHT_ENV, None, 0), read(RETRY_AFTER_ENV, 1, 1)


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
    """The proxy callback: ``[Middleware(ProxyAdmission, ...)]``, following
    the Ingress's limit unless ``KVROUTE_PROXY_MAX_IN_FLIGHT`` fixes one;
    ``[]`` when it is 0."""
    from starlette.middleware import Middleware

    max_in_flight, retry_after_s = settings_from_env()
    if max_in_flight == 0:
        return []
    logger.info("proxy admission: %s generation requests in flight, Retry-After %d s",
                "the Ingress replicas' limits" if max_in_flight is None else max_in_flight, retry_after_s)
    return [Middleware(ProxyAdmission, max_in_flight=max_in_flight, retry_after_s=retry_after_s,
                       on_refused=_refusal_counter())]
