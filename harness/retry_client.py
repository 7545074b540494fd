"""A client that does what the API asks of a well-behaved caller: retry an
explicit retriable error after ``Retry-After``, and nothing else.

Retriable: HTTP 429/503 with ``Retry-After``, or a streamed error event whose
``code`` is one the server uses for "try again" (a replica failed mid-stream,
the server is busy). Anything else — a 5xx without ``Retry-After``, a reset
connection, a stream that ends without its summary — is final, and a request
that ends that way was *lost*. Every attempt is recorded, so the reliability
figures (lost, errors by kind, time to recover) come from these records.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from harness.sse import DONE, sse_event

RETRIABLE_STATUSES = (429, 503)
RETRIABLE_CODES = ("replica_failed", "overloaded", "engine_overloaded")
DEFAULT_RETRY_S = 0.5  # for a mid-stream error event (no header to read)
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def client_session(max_connections: int = 256, headers: dict | None = None) -> aiohttp.ClientSession:
    """A session for :func:`send` (aiohttp: its connection pool stays cheap with
    thousands of requests pending, which an open-loop overload needs)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections, force_close=False),
                                 headers=headers, trust_env=False)


@dataclass(slots=True)
class Attempt:
    start_s: float  # time.monotonic()
    end_s: float = 0.0
    status: int = 0  # HTTP status; 599: transport failure; 200 + error: failed mid-stream
    code: str | None = None  # the error body's code
    retry_after_s: float | None = None
    replica_id: str | None = None
    cached_tokens: int | None = None  # prompt tokens the server reused from its prefix cache
    num_tokens: int = 0
    error: str | None = None
    first_token_s: float | None = None  # time.monotonic() of the first streamed token
    server_ttft_s: float | None = None  # the engine's own TTFT (submission to first token)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def is_retriable(self) -> bool:
        if self.status in RETRIABLE_STATUSES and self.retry_after_s is not None:
            return True
        return self.status == 200 and self.code in RETRIABLE_CODES

    @property
    def kind(self) -> str:
        """A short label for figures: ``ok``, ``429``, ``stream:replica_failed``, ..."""
        if self.ok:
            return "ok"
        if self.status == 200:
            return f"stream:{self.code or 'broken'}"
        return str(self.status) if self.code is None else f"{self.status}:{self.code}"


@dataclass(slots=True)
class Outcome:
    index: int
    attempts: list[Attempt] = field(default_factory=list)
    token_ids: list[int] | None = None  # the successful attempt's output
    logprobs: list[float] | None = None

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].ok

    @property
    def is_lost(self) -> bool:
        """Ended without success: a final non-retriable failure, or retries exhausted."""
        return not self.ok

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def latency_s(self) -> float:
        return self.attempts[-1].end_s - self.attempts[0].start_s


async def send(client: aiohttp.ClientSession, url: str, body: dict, *, index: int = 0, path: str = "/generate",
               headers: dict | None = None, max_attempts: int = 4, max_wait_s: float = 2.0,
               timeout_s: float = 60.0) -> Outcome:
    """POST ``body`` to ``url + path`` (streamed if ``body["stream"]``), retrying
    explicit retriable errors after their ``Retry-After`` (capped at ``max_wait_s``)."""
    outcome = Outcome(index)
    for _ in range(max_attempts):
        attempt = Attempt(time.monotonic())
        outcome.attempts.append(attempt)
        try:
            if body.get("stream"):
                await _streamed(client, url + path, body, headers, timeout_s, attempt, outcome)
            else:
                await _whole(client, url + path, body, headers, timeout_s, attempt, outcome)
        except TRANSPORT_ERRORS as error:
            attempt.status, attempt.error = 599, f"{type(error).__name__}: {error}"[:200]
        attempt.end_s = time.monotonic()
        if attempt.ok or not attempt.is_retriable:
            break
        await asyncio.sleep(min(attempt.retry_after_s or DEFAULT_RETRY_S, max_wait_s))
    return outcome


def _error_fields(attempt: Attempt, payload: dict) -> None:
    error = payload.get("error") if isinstance(payload, dict) else None
    error = error if isinstance(error, dict) else {}
    attempt.code = error.get("code")
    attempt.error = str(error.get("message") or payload)[:200]


def _retry_after(response: aiohttp.ClientResponse) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _whole(client, url, body, headers, timeout_s, attempt: Attempt, outcome: Outcome) -> None:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with client.post(url, json=body, headers=headers, timeout=timeout) as response:
        attempt.status = response.status
        attempt.retry_after_s = _retry_after(response)
        text = await response.text()
    try:
        payload = json.loads(text)
    except ValueError:
        attempt.error = f"not JSON: {text[:100]!r}"
        return
    if attempt.status != 200:
        _error_fields(attempt, payload)
        return
    attempt.replica_id = payload.get("replica_id")
    attempt.cached_tokens = payload.get("cached_tokens")
    outcome.token_ids = payload.get("token_ids")
    outcome.logprobs = payload.get("logprobs")
    attempt.num_tokens = len(outcome.token_ids or ())


async def _streamed(client, url, body, headers, timeout_s, attempt: Attempt, outcome: Outcome) -> None:
    tokens: list[int] = []
    logprobs: list[float] = []
    summary, finished = None, False
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with client.post(url, json=body, headers=headers, timeout=timeout) as response:
        attempt.status = response.status
        attempt.retry_after_s = _retry_after(response)
        if response.status != 200:
            text = await response.text()
            try:
                _error_fields(attempt, json.loads(text))
            except ValueError:
                attempt.error = text[:200]
            return
        async for raw in response.content:
            event = sse_event(raw.decode())
            if event is None:
                continue
            if event == DONE:
                finished = True
                break
            if "error" in event:
                _error_fields(attempt, event)
            elif event.get("done"):
                summary = event
            elif "token_id" in event:
                if not tokens:
                    attempt.first_token_s = time.monotonic()
                tokens.append(event["token_id"])
                logprobs.append(event.get("logprob"))
    attempt.num_tokens = len(tokens)
    if attempt.error is not None:
        return
    if summary is None or not finished:
        attempt.error = "the stream ended without its summary"
        return
    attempt.replica_id = summary.get("replica_id")
    attempt.cached_tokens = summary.get("cached_tokens")
    attempt.server_ttft_s = summary.get("ttft_s")
    outcome.token_ids = tokens
    outcome.logprobs = logprobs
