"""An open-loop sender that leaves the cores to the server it loads.

On this machine the load generator shares 2 cores with the cluster it
overloads, so every millisecond of client CPU per request is taken from
the engines (RELIABILITY.md section 2: aiohttp's client costs ~1.1 ms per
request, ~0.2 cores at 10× capacity). This sender does what a real client
elsewhere would, with as little work here as HTTP/1.1 allows: each request's
bytes are built once before the clock starts, connections are kept alive
and reused, and a response is read by its status line, ``Content-Length``
and ``Retry-After`` (its JSON parsed only to name an error code or the
serving replica).

Non-streamed requests only (a streamed one needs SSE parsing: use
:func:`harness.traffic.open_loop`). No retries: an overload round takes
every answer as it comes. Outcomes are :class:`harness.retry_client.Outcome`
as :func:`~harness.traffic.open_loop` returns them.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

from harness.retry_client import Attempt, Outcome, _error_fields

_TRANSPORT_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError)


def request_bytes(url: str, body: dict, headers: dict | None = None, path: str = "/generate") -> bytes:
    """The whole HTTP/1.1 request for POSTing ``body`` as JSON (keep-alive)."""
    if body.get("stream"):
        raise ValueError("lean_sender sends non-streamed requests only")
    payload = json.dumps(body, separators=(",", ":")).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {urlsplit(url).netloc}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class _Connections:
    """Kept-alive connections to one host, at most ``limit`` open at once."""

    def __init__(self, url: str, limit: int) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(limit)

    async def exchange(self, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        """``(status, headers with lower-case names, body)`` of one request. A
        kept-alive connection the server closed meanwhile (nothing came back)
        is replaced by a fresh one once, as any HTTP client does."""
        async with self._slots:
            if self._idle:
                try:
                    return await self._exchange_on(*self._idle.pop(), request)
                except asyncio.IncompleteReadError as error:
                    if error.partial:
                        raise
            return await self._exchange_on(*await asyncio.open_connection(self.host, self.port), request)

    async def _exchange_on(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head[:-4].split(b"\r\n")
            status = int(status_line.split(b" ", 2)[1])
            headers = {}
            for line in header_lines:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            body = await _read_body(reader, headers)
        except BaseException:
            writer.close()
            raise
        if headers.get(b"connection", b"").lower() == b"close":
            writer.close()
        else:
            self._idle.append((reader, writer))
        return status, headers, body

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _read_body(reader: asyncio.StreamReader, headers: dict[bytes, bytes]) -> bytes:
    if b"content-length" in headers:
        return await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
        raise ValueError("a response with neither Content-Length nor chunked encoding")
    chunks = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        chunk = await reader.readexactly(size + 2)  # the chunk and its CRLF
        if not size:
            return b"".join(chunks)
        chunks.append(chunk[:-2])


def _fill(attempt: Attempt, outcome: Outcome, status: int, headers: dict[bytes, bytes], body: bytes) -> None:
    attempt.status = status
    retry_after = headers.get(b"retry-after")
    try:
        attempt.retry_after_s = float(retry_after) if retry_after is not None else None
    except ValueError:
        attempt.retry_after_s = None
    try:
        payload = json.loads(body)
    except ValueError:
        attempt.error = f"not JSON: {body[:100]!r}"
        return
    if status != 200:
        _error_fields(attempt, payload)
        return
    attempt.replica_id = payload.get("replica_id")
    attempt.cached_tokens = payload.get("cached_tokens")
    outcome.token_ids = payload.get("token_ids")
    attempt.num_tokens = len(outcome.token_ids or ())


async def lean_open_loop(url: str, bodies: list[dict], rate_rps: float, *, headers: dict | None = None,
                         max_connections: int = 1024, timeout_s: float = 60.0) -> list[Outcome]:
    """POST each of ``bodies`` to ``url``/generate at ``rate_rps`` (open loop),
    one attempt each."""
    requests = [request_bytes(url, body, headers) for body in bodies]
    connections = _Connections(url, max_connections)

    async def one(index: int, request: bytes) -> Outcome:
        outcome = Outcome(index, [Attempt(time.monotonic())])
        attempt = outcome.attempts[0]
        try:
            async with asyncio.timeout(timeout_s):
                status, response_headers, body = await connections.exchange(request)
            _fill(attempt, outcome, status, response_headers, body)
        except _TRANSPORT_ERRORS as error:
            attempt.status, attempt.error = 599, f"{type(error).__name__}: {error}"[:200]
        attempt.end_s = time.monotonic()
        return outcome

    try:
        start, tasks = time.monotonic(), []
        for index, request in enumerate(requests):
            delay = start + index / rate_rps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, request)))
        return list(await asyncio.gather(*tasks))
    finally:
        connections.close()
