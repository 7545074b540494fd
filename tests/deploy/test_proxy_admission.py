"""kvroute's admission as a middleware of Serve's HTTP proxy
(deploy/proxy_admission.py), on plain ASGI: what it lets through, what it
refuses and how, and that every place it gives is given back."""

from __future__ import annotations

import asyncio
import json

import pytest

from deploy.proxy_admission import (CALLBACK, MAX_IN_FLIGHT_ENV, RETRY_AFTER_ENV, ProxyAdmission, middlewares,
                                     settings_from_env)


class HeldApp:
    """An ASGI app whose generation responses wait for ``release``; counts calls."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        if scope["path"] != "/health":
            await self.release.wait()
        if scope["path"] == "/v1/completions" and scope.get("fail"):
            raise RuntimeError("the app failed")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(middleware, path: str, method: str = "POST", **extra) -> tuple[int, dict, bytes]:
    """One request through ``middleware``: (status, headers, body)."""
    messages = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        messages.append(message)

    await middleware({"type": "http", "method": method, "path": path, "headers": [], **extra}, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_beyond_the_limit_generation_requests_get_the_json_429_and_the_rest_pass():
    refused = []

    async def main():
        app = HeldApp()
        proxy = ProxyAdmission(app, max_in_flight=2, retry_after_s=3, on_refused=lambda: refused.append(1))
        held = [asyncio.create_task(call(proxy, path)) for path in ("/generate", "/v1/chat/completions")]
        await asyncio.sleep(0.01)
        assert proxy.admission.num_in_flight == 2
        over = [await call(proxy, path) for path in ("/v1/completions", "/generate_batch")]
        health = asyncio.create_task(call(proxy, "/health", method="GET"))
        models = asyncio.create_task(call(proxy, "/v1/models", method="GET"))
        not_post = asyncio.create_task(call(proxy, "/generate", method="GET"))
        await asyncio.sleep(0.01)
        assert health.done() and (await health)[0] == 200  # never counted, never refused
        app.release.set()
        done = [await task for task in (*held, models, not_post)]
        return app, proxy, over, done

    app, proxy, over, done = asyncio.run(main())
    for status, headers, body in over:
        assert status == 429
        assert headers["retry-after"] == "3" and headers["x-kvroute-refused-by"] == "proxy"
        assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body)
        error = json.loads(body)["error"]
        assert error["code"] == "overloaded" and error["type"] and "2 requests in flight" in error["message"]
    assert [status for status, *_ in done] == [200] * 4
    assert app.calls == 5  # the two refusals never reached the app
    assert refused == [1, 1] and proxy.admission.num_refused == 2
    assert proxy.admission.num_in_flight == 0


def test_a_failed_or_abandoned_request_gives_its_place_back():
    async def main():
        app = HeldApp()
        app.release.set()
        proxy = ProxyAdmission(app, max_in_flight=1)
        with pytest.raises(RuntimeError):
            await call(proxy, "/v1/completions", fail=True)
        assert proxy.admission.num_in_flight == 0
        blocked = HeldApp()
        proxy = ProxyAdmission(blocked, max_in_flight=1)
        task = asyncio.create_task(call(proxy, "/generate"))
        await asyncio.sleep(0.01)
        assert (await call(proxy, "/generate"))[0] == 429
        task.cancel()  # the client went away mid-request
        with pytest.raises(asyncio.CancelledError):
            await task
        assert proxy.admission.num_in_flight == 0
        blocked.release.set()
        return await call(proxy, "/generate")

    assert asyncio.run(main())[0] == 200


def test_settings_come_from_the_environment_and_bad_values_are_named():
    assert settings_from_env({}) == (0, 1)
    assert settings_from_env({MAX_IN_FLIGHT_ENV: " 12 ", RETRY_AFTER_ENV: "2"}) == (12, 2)
    for env, name in (({MAX_IN_FLIGHT_ENV: "ten"}, MAX_IN_FLIGHT_ENV), ({MAX_IN_FLIGHT_ENV: "-1"}, MAX_IN_FLIGHT_ENV),
                      ({RETRY_AFTER_ENV: "0"}, RETRY_AFTER_ENV), ({RETRY_AFTER_ENV: "1.5"}, RETRY_AFTER_ENV)):
        with pytest.raises(ValueError, match=name):
            settings_from_env(env)
    with pytest.raises(ValueError, match="max_in_flight"):
        ProxyAdmission(HeldApp(), max_in_flight=0)


def test_the_proxy_callback_installs_the_middleware_only_when_a_limit_is_set(monkeypatch):
    from starlette.middleware import Middleware

    from ray.serve._private.http_util import validate_http_proxy_callback_return

    module, _, function = CALLBACK.partition(":")
    assert (module, function) == ("deploy.proxy_admission", "middlewares")
    monkeypatch.delenv(MAX_IN_FLIGHT_ENV, raising=False)
    assert middlewares() == []
    monkeypatch.setenv(MAX_IN_FLIGHT_ENV, "12")
    monkeypatch.setenv(RETRY_AFTER_ENV, "2")
    installed = validate_http_proxy_callback_return(middlewares())  # what Serve's proxy checks it with
    assert len(installed) == 1 and isinstance(installed[0], Middleware) and installed[0].cls is ProxyAdmission
    assert (installed[0].kwargs["max_in_flight"], installed[0].kwargs["retry_after_s"]) == (12, 2)
