"""Hostile input against the live app: schema-driven fuzzing (zero 5xx), body
and prompt limits, and slow or stalled clients that must time out without
starving anyone else."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from harness.faults import wait_for_clean_audits
from tests.reliability.conftest import API_KEY, AUTH, BODY_TIMEOUT_S, CORE_LIMITS, tokens

pytestmark = pytest.mark.ray


def post(app, path, body, **kwargs):
    return httpx.post(app.url + path, json=body, headers=kwargs.pop("headers", AUTH), timeout=60, trust_env=False,
                      **kwargs)


# ------------------------------------------------------------------ fuzzing
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzzing_finds_no_5xx(core_app, mode):
    """Every operation in the app's own OpenAPI schema, with schema-valid
    (``positive``) and schema-violating (``negative``) inputs: never a 5xx,
    every error an OpenAI-style body; afterwards every replica's audit is clean."""
    openapi = httpx.get(core_app.url + "/openapi.json", headers=AUTH, trust_env=False).json()
    schema = schemathesis.openapi.from_dict(openapi)
    session = requests.Session()
    session.trust_env = False
    failures, counts, exercised = [], {}, []
    start_s = time.time()
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        def check(case):
            try:
                response = case.call(base_url=core_app.url, session=session, timeout=30,
                                     headers={"Authorization": f"Bearer {API_KEY}"})
            except requests.RequestException as error:  # a hang is a failure too (no slow shrinking)
                failures.append((operation.label, type(error).__name__, case.body))
                return
            counts[response.status_code] = counts.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append((operation.label, response.status_code, response.text[:300], case.body))
            elif response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and error["type"], response.text

        try:
            check()
        except Unsatisfiable:  # no input to violate (GET /health): nothing to send in negative mode
            assert mode == "negative" and operation.method.upper() == "GET", operation.label
            continue
        exercised.append(operation.label)
    print(f"FIGURES fuzz[{mode}]: {sum(counts.values())} requests, statuses {dict(sorted(counts.items()))}")
    assert not failures, failures[:5]
    assert {"POST /generate", "POST /generate_batch", "POST /v1/completions", "POST /v1/chat/completions"} <= set(exercised)
    assert sum(counts.values()) >= 40, counts
    for audit in wait_for_clean_audits(core_app.url, 2, after_s=start_s, headers=AUTH):
        assert audit.is_clean, audit


def test_fan_out_requests_complete(core_app):
    """Found by the fuzzer: one HTTP request's concurrent worker calls (batch
    groups of short prompts, OpenAI prompts × choices) shared Serve's internal
    request id, and our request router served only one of them; the rest hung."""
    batch = httpx.post(core_app.url + "/generate_batch", json={"prompts": [[0], [0], [65, 66], [67]], "max_new_tokens": 2},
                       headers=AUTH, timeout=30, trust_env=False)
    assert batch.status_code == 200 and all("token_ids" in o for o in batch.json()["outputs"]), batch.text
    choices = httpx.post(core_app.url + "/v1/completions", headers=AUTH, timeout=30, trust_env=False, json={
        "model": "tiny-llama", "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})
    assert choices.status_code == 200 and len(choices.json()["choices"]) == 9, choices.text


# ------------------------------------------- headers, paths and raw bodies
_PATHS = ["/generate", "/generate_batch", "/v1/completions", "/v1/chat/completions", "/v1/models", "/stats",
          "/metrics", "/health", "/docs", "/openapi.json"]
_CONTENT_TYPES = [b"application/json", b"text/plain", b"application/x-www-form-urlencoded",
                  b"multipart/form-data; boundary=x", b"application/json; charset=utf-16", b"", b"\xff\xfe/\x00",
                  b"application/json" + b";a=b" * 200]


def hostile_requests(seed: int, count: int) -> list[bytes]:
    """Raw HTTP/1.1 requests: arbitrary bytes in Authorization (sometimes a
    valid key with garbage around it), odd content types, oversized headers,
    random paths (percent-encoded bytes, dot segments, huge), random bodies."""
    rng = random.Random(seed)
    requests_ = []
    for index in range(count):
        if index % 10 == 0:  # a valid request now and then: the server must keep serving
            body = b'{"prompt_token_ids": [72, 105, %d], "max_new_tokens": 2}' % rng.randrange(35, 130)
            requests_.append(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + API_KEY.encode()
                             + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                             + b"\r\nConnection: close\r\n\r\n" + body)
            continue
        path = rng.choice(_PATHS)
        roll = rng.random()
        if roll < 0.25:
            path = "/" + "".join(rng.choice("abc/%..~-_") for _ in range(rng.randrange(1, 40)))
        elif roll < 0.35:
            path = "/" + "".join(f"%{rng.randrange(256):02X}" for _ in range(rng.randrange(1, 30)))
        elif roll < 0.4:
            path = "/v1/" + "x" * rng.choice([100, 5000, 20000])
        method = rng.choice([b"POST", b"POST", b"GET", b"PUT", b"DELETE", b"OPTIONS", b"HEAD"])
        key = API_KEY.encode()
        auth = rng.choice([
            b"Bearer " + key, b"Bearer " + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80))),
            "Bearer sécret".encode(), b"Bearer " + key + b"\xff", bytes(rng.randrange(128, 256) for _ in range(20)),
            b"Bearer " + b"A" * rng.choice([1000, 16000]), b"Basic " + key, b"",
        ]).replace(b"\r", b"").replace(b"\n", b"")
        body = rng.choice([
            b'{"prompt_token_ids": [72, 105], "max_new_tokens": 2}',
            b'{"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2}',
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}',
            bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))),
            b'{"prompt_token_ids": [' + b"1," * rng.randrange(0, 2000) + b'1]}', b"{" * 500, b"",
        ])
        headers = [b"Host: 127.0.0.1", b"Authorization: " + auth, b"Content-Type: " + rng.choice(_CONTENT_TYPES),
                   b"Content-Length: " + str(len(body)).encode(), b"Connection: close"]
        if rng.random() < 0.15:
            headers.append(b"X-Cache-Salt: " + bytes(rng.randrange(32, 256) for _ in range(rng.randrange(1, 3000))))
        if rng.random() < 0.1:
            headers.append(b"X-Padding: " + b"p" * rng.choice([8000, 70000]))  # oversized header
        if rng.random() < 0.05:
            headers.append(b"Transfer-Encoding: chunked")  # conflicting framing
        requests_.append(method + b" " + path.encode() + b" HTTP/1.1\r\n" + b"\r\n".join(headers) + b"\r\n\r\n"
                         + body)
    return requests_


async def _send_raw(port: int, raw: bytes, timeout_s: float = 30.0) -> tuple[int | None, bytes]:
    """(status, head and body) of one raw request; status None when the server closed without answering."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout_s)
    except (ConnectionError, asyncio.TimeoutError):
        data = b""
    finally:
        writer.close()
    try:
        return int(data.split(b" ", 2)[1]), data
    except (IndexError, ValueError):
        return None, data


def test_hostile_headers_paths_and_bodies_get_no_5xx_with_keys_configured(core_app):
    """Against the app with API keys: arbitrary Authorization bytes, content
    types, oversized headers, random paths and bodies. No answer >= 500
    except a documented overload 503 with Retry-After; a 401 is OpenAI JSON."""
    port = int(core_app.url.rsplit(":", 1)[1])
    cases = hostile_requests(seed=12, count=400)
    start_s = time.time()

    async def run_all():
        limit = asyncio.Semaphore(16)

        async def one(raw):
            async with limit:
                return raw, *await _send_raw(port, raw)

        return await asyncio.gather(*(one(raw) for raw in cases))

    results = asyncio.run(run_all())
    counts: dict = {}
    failures = []
    for raw, status, data in results:
        counts[status] = counts.get(status, 0) + 1
        head, _, body = data.partition(b"\r\n\r\n")
        if status is not None and status >= 500 and not (status == 503 and b"retry-after" in head.lower()):
            failures.append((raw[:200], data[:300]))
        if status == 401:
            error = json.loads(body)["error"]
            assert error["message"] and error["type"] == "authentication_error", body
        if status is not None and status >= 500:
            assert b"Traceback" not in body and b"Error:" not in body, body[:300]
    print(f"FIGURES hostile headers/paths/bodies: {len(cases)} requests, statuses "
          f"{dict(sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))}")
    assert not failures, failures[:3]
    assert counts.get(401, 0) >= 20 and counts.get(200, 0) >= 40, counts  # both sides of the key were exercised
    for audit in wait_for_clean_audits(core_app.url, 2, after_s=start_s, headers=AUTH):
        assert audit.is_clean, audit


# ------------------------------------------------------------------- limits
def test_body_limit_holds_for_declared_and_chunked_bodies(core_app):
    limit = CORE_LIMITS["max_body_bytes"]
    big = b'{"prompt_token_ids": [' + b"1, " * (limit // 3) + b'1], "max_new_tokens": 1}'
    declared = httpx.post(core_app.url + "/generate", content=big, headers={**AUTH, "content-type": "application/json"},
                          trust_env=False)
    assert declared.status_code == 413, declared.text

    def chunks():  # no Content-Length: the size is only known while reading
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    chunked = httpx.post(core_app.url + "/generate", content=chunks(),
                         headers={**AUTH, "content-type": "application/json"}, trust_env=False, timeout=30)
    assert chunked.status_code == 413, chunked.text
    assert "larger than" in chunked.json()["error"]["message"]


def test_prompt_and_request_limits_are_4xx(core_app):
    over = post(core_app, "/generate", {"prompt_token_ids": tokens(1, CORE_LIMITS["max_prompt_tokens"] + 1)})
    assert over.status_code == 400 and "over the limit" in over.json()["error"]["message"]
    many = post(core_app, "/generate_batch", {"prompts": [[65]] * (CORE_LIMITS["max_batch_prompts"] + 1)})
    assert many.status_code == 400
    choices = post(core_app, "/v1/completions", {"model": "tiny-llama", "prompt": "x", "n": CORE_LIMITS["max_n"] + 1})
    assert choices.status_code == 400
    long_output = post(core_app, "/generate", {"prompt_token_ids": [65], "max_new_tokens": 10_000})
    assert long_output.status_code == 400


# ------------------------------------------------------------ slow clients
async def _slow_request(port: int, body: bytes, *, num_sent: int, trickle_s: float | None,
                        extra_headers: str = "") -> tuple[int | None, float]:
    """A POST whose body arrives slowly or never; returns (status, seconds to answer)."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n{extra_headers}\r\n")
    writer.write(head.encode() + body[:num_sent])
    await writer.drain()

    async def trickle():
        for i in range(num_sent, len(body)):
            await asyncio.sleep(trickle_s)
            writer.write(body[i : i + 1])
            await writer.drain()

    trickler = asyncio.ensure_future(trickle()) if trickle_s else None
    try:
        line = await asyncio.wait_for(reader.readline(), timeout=BODY_TIMEOUT_S + 20)
        status = int(line.split()[1]) if line else None
    except (asyncio.TimeoutError, ConnectionError, IndexError, ValueError):
        status = None
    finally:
        if trickler:
            trickler.cancel()
        writer.close()
    return status, time.monotonic() - start


def test_stalled_and_trickling_bodies_time_out_while_others_are_served(core_app):
    port = int(core_app.url.rsplit(":", 1)[1])
    body = b'{"prompt_token_ids": [72, 101, 108, 108, 111], "max_new_tokens": 4}'

    async def scenario():
        slow = [_slow_request(port, body, num_sent=10, trickle_s=None) for _ in range(12)]  # stalled
        slow += [_slow_request(port, body, num_sent=5, trickle_s=0.25) for _ in range(12)]  # 1 byte / 0.25 s
        # The proxy's own timeout switched off by the client: our deadline still holds.
        slow += [_slow_request(port, body, num_sent=10, trickle_s=None,
                               extra_headers="x-request-timeout-seconds: 0\r\n") for _ in range(4)]
        slow_tasks = [asyncio.ensure_future(s) for s in slow]
        await asyncio.sleep(0.5)
        latencies = []
        async with httpx.AsyncClient(trust_env=False, headers=AUTH, timeout=30) as client:
            for i in range(20):  # normal traffic while the slow ones hang
                begin = time.monotonic()
                response = await client.post(core_app.url + "/generate",
                                             json={"prompt_token_ids": tokens(100 + i, 20), "max_new_tokens": 4})
                assert response.status_code == 200, response.text
                latencies.append(time.monotonic() - begin)
                await asyncio.sleep(0.05)
        return await asyncio.gather(*slow_tasks), latencies

    slow_results, latencies = asyncio.run(scenario())
    print(f"FIGURES slow clients: {len(slow_results)} slow, answered {sorted({s for s, _ in slow_results})} after "
          f"{min(e for _, e in slow_results):.2f}-{max(e for _, e in slow_results):.2f} s; 20 normal requests meanwhile: "
          f"max latency {max(latencies):.3f} s")
    assert max(latencies) < 2.0, latencies  # nobody waited behind the slow clients
    statuses = [status for status, _ in slow_results]
    assert statuses == [408] * len(slow_results), statuses
    for _, elapsed_s in slow_results:
        assert BODY_TIMEOUT_S - 0.5 <= elapsed_s <= BODY_TIMEOUT_S + 5, elapsed_s


def test_half_sent_headers_do_not_block_the_server(core_app):
    port = int(core_app.url.rsplit(":", 1)[1])

    async def scenario():
        writers = []
        for _ in range(30):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            await writer.drain()
            writers.append(writer)
        try:
            async with httpx.AsyncClient(trust_env=False, headers=AUTH, timeout=10) as client:
                responses = [await client.post(core_app.url + "/generate",
                                               json={"prompt_token_ids": tokens(200 + i, 12), "max_new_tokens": 2})
                             for i in range(5)]
        finally:
            for writer in writers:
                writer.close()
        return responses

    assert [r.status_code for r in asyncio.run(scenario())] == [200] * 5
