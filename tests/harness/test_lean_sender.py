"""harness/lean_sender.py against a real HTTP/1.1 server on 127.0.0.1
(asyncio's, answering by the request's prompt): statuses, Retry-After and
error codes read as harness.retry_client reads them, chunked bodies,
connections kept alive and reused, a server-closed connection replaced."""

from __future__ import annotations

import asyncio
import json

import pytest

from harness.lean_sender import lean_open_loop, request_bytes


class _Server:
    """Answers POST /generate by ``prompt_token_ids[0]``: 0 → 200 JSON,
    1 → 429 + Retry-After, 2 → 200 chunked, 3 → 200 then closes the
    connection (``Connection: close``), 4 → closes without answering."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = json.loads(await reader.readexactly(length))
                self.requests += 1
                kind = body["prompt_token_ids"][0]
                ok = json.dumps({"token_ids": [7, 8], "replica_id": "r1", "cached_tokens": 3}).encode()
                if kind == 0:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(ok), ok))
                elif kind == 1:
                    refusal = json.dumps({"error": {"message": "busy", "code": "overloaded"}}).encode()
                    writer.write(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(refusal), refusal))
                elif kind == 2:
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (ok[:5], ok[5:]))
                                 + b"0\r\n\r\n")
                elif kind == 3:
                    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(ok), ok))
                    await writer.drain()
                    break
                else:
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.CancelledError):  # the client left, or the test ended
            pass
        finally:
            writer.close()


def _run(kinds: list[int], rate_rps: float = 500.0, max_connections: int = 4):
    async def main():
        server = _Server()
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        async with listener:
            outcomes = await lean_open_loop(f"http://127.0.0.1:{port}",
                                            [{"prompt_token_ids": [k], "max_new_tokens": 2} for k in kinds],
                                            rate_rps, headers={"Authorization": "Bearer k"},
                                            max_connections=max_connections, timeout_s=5)
        return outcomes, server

    return asyncio.run(main())


def test_statuses_retry_after_codes_and_bodies_read_like_the_retry_client():
    outcomes, _ = _run([0, 1, 2])
    ok, refused, chunked = (o.final for o in outcomes)
    assert ok.ok and ok.replica_id == "r1" and ok.cached_tokens == 3 and ok.num_tokens == 2
    assert outcomes[0].token_ids == [7, 8]
    assert refused.status == 429 and refused.retry_after_s == 1.0 and refused.code == "overloaded"
    assert refused.kind == "429:overloaded" and not refused.ok
    assert chunked.ok and chunked.replica_id == "r1"
    assert [o.index for o in outcomes] == [0, 1, 2]
    assert all(o.latency_s >= 0 for o in outcomes)


def test_connections_are_kept_alive_and_reused():
    outcomes, server = _run([0, 1] * 20, rate_rps=200.0, max_connections=2)
    assert all(o.final.status in (200, 429) for o in outcomes)
    assert server.requests == 40 and server.connections <= 2


def test_a_connection_the_server_closed_is_replaced_and_a_dropped_answer_is_a_transport_failure():
    outcomes, server = _run([3, 0, 4, 0], rate_rps=20.0, max_connections=1)
    assert [o.final.status for o in outcomes] == [200, 200, 599, 200]
    assert "IncompleteReadError" in outcomes[2].final.error
    # 0 on the first (closed by the server), 1 on a second, 2 on the second (dropped: nothing came back on a
    # kept-alive connection, so tried once more on a third, dropped again), 3 on a fourth
    assert server.connections == 4 and server.requests == 5


def test_streamed_requests_are_refused():
    with pytest.raises(ValueError, match="non-streamed"):
        request_bytes("http://127.0.0.1:1", {"prompt_token_ids": [1], "stream": True})
