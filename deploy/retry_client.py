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

import httpx

RETRIABLE_STATUSES = (429, 503)
RETRIABLE_CODES = ("replica_failed", "overloaded", "engine_overloaded")
DEFAULT_RETRY_S = 0.5  # for a mid-stream error event (no header to read)


@dataclass(slots=True)
class Attempt:
    start_s: float  # time.monotonic()
    end_s: float = 0.0
    status: int = 0  # HTTP status; 599: transport failure; 200 + error: failed mid-stream
    code: str | None = None  # the error body's code
    retry_after_s: float | None = None
    replica_id: str | None = None
    num_tokens: int = 0
    error: str | None = None

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


async def send(client: httpx.AsyncClient, url: str, body: dict, *, index: int = 0, path: str = "/generate",
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
        except (httpx.HTTPError, asyncio.TimeoutError) as error:
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


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _whole(client, url, body, headers, timeout_s, attempt: Attempt, outcome: Outcome) -> None:
    response = await client.post(url, json=body, headers=headers, timeout=timeout_s)
    attempt.status = response.status_code
    attempt.retry_after_s = _retry_after(response)
    try:
        payload = response.json()
    except ValueError:
        attempt.error = f"not JSON: {response.text[:100]!r}"
        return
    if response.status_code != 200:
        _error_fields(attempt, payload)
        return
    attempt.replica_id = payload.get("replica_id")
    outcome.token_ids = payload.get("token_ids")
    outcome.logprobs = payload.get("logprobs")
    attempt.num_tokens = len(outcome.token_ids or ())


async def _streamed(client, url, body, headers, timeout_s, attempt: Attempt, outcome: Outcome) -> None:
    tokens: list[int] = []
    logprobs: list[float] = []
    summary, finished = None, False
    async with client.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as response:
        attempt.status = response.status_code
        attempt.retry_after_s = _retry_after(response)
        if response.status_code != 200:
            await response.aread()
            try:
                _error_fields(attempt, response.json())
            except ValueError:
                attempt.error = response.text[:200]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                finished = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                _error_fields(attempt, event)
            elif event.get("done"):
                summary = event
            elif "token_id" in event:
                tokens.append(event["token_id"])
                logprobs.append(event.get("logprob"))
    attempt.num_tokens = len(tokens)
    if attempt.error is not None:
        return
    if summary is None or not finished:
        attempt.error = "the stream ended without its summary"
        return
    attempt.replica_id = summary.get("replica_id")
    outcome.token_ids = tokens
    outcome.logprobs = logprobs
