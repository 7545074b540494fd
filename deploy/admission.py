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
read), counted in *worker requests*: what a request puts on the Workers.
The guard admits every request at weight 1 before its body is read (so a
refusal costs no parsing); once the route knows the fan-out (``n`` choices ×
prompts, or a batch's prompts) it raises the weight with :func:`charge`,
which refuses the request (429, the same body) if the extra does not fit. A
request heavier than the whole limit is charged the limit: it runs when it
is alone, rather than never.

Each ingress replica counts its own requests: with R ingress replicas the
cluster admits up to R × the limit (Serve's proxy spreads requests evenly
over them, so each sees ~1/R of the load and of the admitted work). Either
set ``max_in_flight_per_worker`` to the per-Worker bound divided by R, or
read it as a per-ingress-replica bound (docs: deploy/README.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
from collections.abc import Awaitable, Callable

from deploy.errors import APIError, error_body

logger = logging.getLogger("kvroute.ingress")
STARTUP_REFRESH_S = 0.25  # how soon to count again when no Worker was live (they post their first stats)
RECOUNT_BEFORE_REFUSAL_S = 0.25  # a refusal recounts the live Workers first when the count is older than this
RECOUNT_TIMEOUT_S = 0.5  # and waits at most this for the count

GENERATION_PATHS = frozenset({"/generate", "/generate_batch", "/v1/completions", "/v1/chat/completions"})
# On every generation response (admitted or refused): "<guard token> <limit>", so a front that counts
# requests (deploy/proxy_admission.py) can follow each Ingress replica's current limit; 0: admission off.
LIMIT_HEADER = b"x-kvroute-admission-limit"


class Ticket:
    """One admitted request's weight (worker requests it holds), kept in the
    ASGI scope under :data:`SCOPE_KEY` so the route can :func:`charge` it."""

    __slots__ = ("weight",)

    def __init__(self, weight: int = 1) -> None:
        self.weight = weight


SCOPE_KEY = "kvroute.admission"


class Admission:
    """In-flight counting in worker requests. Invariant: ``0 <= num_in_flight``
    = the sum of the weights of the tickets admitted and not yet released; a
    ticket :meth:`try_admit` returned is :meth:`release` d exactly once."""

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

    def try_admit(self) -> Ticket | None:
        """A ticket of weight 1, or None (refused) when the limit is reached."""
        if self.is_enabled and self.num_in_flight >= self.limit:
            self.num_refused += 1
            return None
        self.num_in_flight += 1
        return Ticket()

    def admit_over_limit(self) -> Ticket:
        """A ticket of weight 1 whatever the count (a probe past a limit that may be stale)."""
        self.num_in_flight += 1
        return Ticket()

    def try_charge(self, ticket: Ticket, weight: int) -> bool:
        """Raise ``ticket`` to ``weight`` (at most the limit); False (refused,
        the ticket unchanged) when the extra does not fit. Never lowers it."""
        if weight < 1:
            raise ValueError(f"weight must be >= 1, got {weight}")
        if self.is_enabled:
            weight = min(weight, self.limit)
        extra = weight - ticket.weight
        if extra <= 0:
            return True
        if self.is_enabled and self.num_in_flight + extra > self.limit:
            self.num_refused += 1
            return False
        self.num_in_flight += extra
        ticket.weight = weight
        return True

    def release(self, ticket: Ticket) -> None:
        assert 0 < ticket.weight <= self.num_in_flight, "release without admit"
        self.num_in_flight -= ticket.weight
        ticket.weight = 0  # a second release trips the assert


class Refusal:
    """The answer to a request over an admission limit: 429, OpenAI-style
    JSON (``code: overloaded``) naming the limit, and ``Retry-After``. Built
    once; :meth:`send` only fills in the limit (no parsing, no allocation
    beyond the body)."""

    def __init__(self, retry_after_s: int, counted: str = "worker requests",
                 extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.retry_after_s = retry_after_s
        self.message = f"server busy: {{limit}} {counted} in flight, the limit; retry after {retry_after_s} s"
        self._body_template = json.dumps(error_body(429, self.message, code="overloaded"))
        self._headers = [(b"content-type", b"application/json"), (b"retry-after", str(retry_after_s).encode()),
                         *extra_headers]

    async def send(self, send, limit: int, extra_headers: list | tuple = ()) -> None:
        body = self._body_template.replace("{limit}", str(limit)).encode()
        await send({"type": "http.response.start", "status": 429,
                    "headers": [*self._headers, (b"content-length", str(len(body)).encode()), *extra_headers]})
        await send({"type": "http.response.body", "body": body})


class AdmissionGuard:
    """ASGI middleware: generation requests beyond :class:`Admission`'s limit
    get 429 ``engine_overloaded``-style JSON with ``Retry-After`` before their
    body is read. ``count_workers``: async () -> live Worker replicas, asked
    at most every ``refresh_period_s`` (on a request's arrival, without
    holding it); a count of 0 (at start-up, before any Worker has posted its
    stats) keeps the last count and asks again after ``STARTUP_REFRESH_S``.
    A request about to be refused first has the count taken again when it is
    older than ``RECOUNT_BEFORE_REFUSAL_S`` (so a Worker that just started
    is counted before anyone is turned away for lack of it); under a flood of
    refusals that is one count per ``RECOUNT_BEFORE_REFUSAL_S``, the other
    refusals wait on the same count or none. Every generation response it
    sees (admitted or refused) carries :data:`LIMIT_HEADER`: this guard's
    random token and its limit now (0 when off, or before the first count
    of live Workers)."""

    def __init__(self, app, admission: Admission, retry_after_s: int,
                 count_workers: Callable[[], Awaitable[int]] | None = None, refresh_period_s: float = 2.0,
                 on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.admission = admission
        self.count_workers = count_workers
        self.refresh_period_s = refresh_period_s
        self.on_refused = on_refused
        self.retry_after_s = retry_after_s
        self._refusal = Refusal(retry_after_s)
        self._token = secrets.token_hex(6)  # tells this guard's limit from another Ingress replica's
        self._counted = count_workers is None  # the limit is a real count, not the start-up guess of one Worker
        self._limit_header_for = (-1, (LIMIT_HEADER, b""))  # (limit, its header), rebuilt when the limit moves
        self._next_refresh_s = 0.0
        self._recount_after_s = -math.inf  # loop time before which a refusal does not recount
        self._refreshing: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self._maybe_refresh()
        if scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        ticket = self.admission.try_admit()
        if ticket is None and await self._recounted():
            ticket = self.admission.try_admit()
        if ticket is None:
            if self.on_refused:
                self.on_refused()
            return await self._refusal.send(send, self.admission.limit, (self._limit_header(),))
        scope[SCOPE_KEY] = (self, ticket)

        async def send_with_limit(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._limit_header()]}
            await send(message)
        try:
            await self.app(scope, receive, send_with_limit)
        finally:
            self.admission.release(ticket)

    def _limit_header(self) -> tuple[bytes, bytes]:
        """This guard's announcement; 0 (nothing to enforce) while admission
        is off or the live Workers have not been counted yet (the start-up
        limit of one Worker's share is a guess that a refusal here recounts,
        which a front holding the figure could not)."""
        limit = self.admission.limit if self.admission.is_enabled and self._counted else 0
        if self._limit_header_for[0] != limit:
            self._limit_header_for = (limit, (LIMIT_HEADER, f"{self._token} {limit}".encode()))
        return self._limit_header_for[1]

    def refusal(self) -> APIError:
        if self.on_refused:
            self.on_refused()
        return APIError(429, self._refusal.message.format(limit=self.admission.limit), code="overloaded",
                        retry_after_s=self.retry_after_s)

    async def _recounted(self) -> bool:
        """Before a refusal: count the live Workers again if the count is older
        than ``RECOUNT_BEFORE_REFUSAL_S`` (a Worker that just started would
        otherwise wait up to a refresh period to be counted), waiting at most
        ``RECOUNT_TIMEOUT_S``; True if the limit went up."""
        if self.count_workers is None:
            return False
        loop = asyncio.get_running_loop()
        if loop.time() < self._recount_after_s:
            return False
        self._recount_after_s = loop.time() + RECOUNT_BEFORE_REFUSAL_S  # whatever the count brings
        limit = self.admission.limit
        try:
            await asyncio.wait_for(asyncio.shield(self._refresh_task()), RECOUNT_TIMEOUT_S)
        except asyncio.TimeoutError:
            return False
        return self.admission.limit > limit

    def _maybe_refresh(self) -> None:
        if self.count_workers is not None and asyncio.get_running_loop().time() >= self._next_refresh_s:
            self._refresh_task()

    def _refresh_task(self) -> asyncio.Task:
        """The count in progress, or a new one."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
        return self._refreshing

    async def _refresh(self) -> None:
        """Count the live Workers; the next scheduled count is a period later
        (``STARTUP_REFRESH_S`` while none has posted its stats yet)."""
        loop = asyncio.get_running_loop()
        self._next_refresh_s = loop.time() + self.refresh_period_s
        try:
            count = await self.count_workers()
        except Exception:  # noqa: BLE001 - keep the last count; the next refresh tries again
            return
        if count <= 0:  # none has posted yet (start-up): keep the count, look again soon
            self._next_refresh_s = loop.time() + STARTUP_REFRESH_S
            return
        self._recount_after_s = loop.time() + RECOUNT_BEFORE_REFUSAL_S
        self._counted = True
        if count != self.admission.num_workers:
            logger.info("admission: %d live Workers (was %d)", count, self.admission.num_workers)
        self.admission.set_num_workers(count)


def charge(scope, weight: int) -> None:
    """Raise the admitted request's weight to ``weight`` worker requests (its
    fan-out); :class:`APIError` 429 + ``Retry-After`` when that does not fit.
    A request that no guard admitted (admission off, another path) is free."""
    guard_and_ticket = scope.get(SCOPE_KEY)
    if guard_and_ticket is None:
        return
    guard, ticket = guard_and_ticket
    if not guard.admission.try_charge(ticket, weight):
        raise guard.refusal()
