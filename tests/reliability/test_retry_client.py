"""The reliability figures count on ``harness.retry_client`` classifying
answers right: retry explicit retriable errors after ``Retry-After``, never
anything else, and call a stream without its summary lost. Checked against a
scripted local HTTP server (no Ray)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from harness.retry_client import client_session, send


def _sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e) if isinstance(e, dict) else e}\n\n".encode() for e in events)


async def _serve(script: list):
    """A server answering POST /generate with ``script``'s responses in turn
    (each entry builds one; the last repeats)."""
    calls = []

    async def handler(request):
        calls.append(await request.json())
        return script[min(len(calls), len(script)) - 1]()

    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", calls


def _run(script, body, **kwargs):
    async def go():
        runner, url, calls = await _serve(script)
        try:
            async with client_session() as client:
                return await send(client, url, body, max_wait_s=0.01, **kwargs), calls
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def _error(status, code, retry_after=None):
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return lambda: web.json_response({"error": {"message": "busy", "type": "x", "code": code}}, status=status,
                                     headers=headers)


def OK():  # noqa: N802 - a response, named like a constant
    return web.json_response({"token_ids": [1, 2], "replica_id": "r1", "cached_tokens": 5})


def _stream(*events):
    return lambda: web.Response(body=_sse(*events), content_type="text/event-stream")


def test_429_and_503_with_retry_after_are_retried_then_succeed():
    outcome, calls = _run([_error(429, "engine_overloaded", 1), _error(503, "overloaded", 1), OK], {"stream": False})
    assert outcome.ok and outcome.token_ids == [1, 2] and len(calls) == 3
    assert [a.kind for a in outcome.attempts] == ["429:engine_overloaded", "503:overloaded", "ok"]
    assert outcome.final.replica_id == "r1" and outcome.final.cached_tokens == 5


def test_5xx_without_retry_after_is_final_and_lost():
    outcome, calls = _run([_error(503, "overloaded"), OK], {"stream": False})
    assert outcome.is_lost and len(calls) == 1 and outcome.final.kind == "503:overloaded"
    outcome, calls = _run([_error(500, None, 1), OK], {"stream": False})
    assert outcome.is_lost and len(calls) == 1  # Retry-After alone does not make a 500 retriable


def test_retries_stop_after_max_attempts():
    outcome, calls = _run([_error(429, "engine_overloaded", 1)], {"stream": False}, max_attempts=3)
    assert outcome.is_lost and len(calls) == 3


def test_stream_cut_by_a_replica_failure_is_retried():
    cut = _stream({"token_id": 7}, {"error": {"message": "gone", "code": "replica_failed"}}, "[DONE]")
    whole = _stream({"token_id": 7}, {"token_id": 8}, {"done": True, "replica_id": "r2"}, "[DONE]")
    outcome, calls = _run([cut, whole], {"stream": True})
    assert outcome.ok and outcome.token_ids == [7, 8] and len(calls) == 2
    assert outcome.attempts[0].kind == "stream:replica_failed"


def test_stream_without_its_summary_is_lost():
    truncated = _stream({"token_id": 7})
    outcome, calls = _run([truncated], {"stream": True})
    assert outcome.is_lost and len(calls) == 1 and outcome.final.kind == "stream:broken"
