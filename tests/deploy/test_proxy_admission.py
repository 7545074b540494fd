"""kvroute's admission as a middleware of Serve's HTTP proxy
(deploy/proxy_admission.py), on plain ASGI: what it lets through, what it
refuses and how, and that every place it gives is given back."""

from __future__ import annotations

import asyncio
import json

import pytest

from deploy.admission import LIMIT_HEADER
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
    assert settings_from_env({}) == (None, 1)  # follow the Ingress
    assert settings_from_env({MAX_IN_FLIGHT_ENV: "auto"}) == (None, 1)
    assert settings_from_env({MAX_IN_FLIGHT_ENV: "0"}) == (0, 1)
    assert settings_from_env({MAX_IN_FLIGHT_ENV: " 12 ", RETRY_AFTER_ENV: "2"}) == (12, 2)
    for env, name in (({MAX_IN_FLIGHT_ENV: "ten"}, MAX_IN_FLIGHT_ENV), ({MAX_IN_FLIGHT_ENV: "-1"}, MAX_IN_FLIGHT_ENV),
                      ({RETRY_AFTER_ENV: "0"}, RETRY_AFTER_ENV), ({RETRY_AFTER_ENV: "1.5"}, RETRY_AFTER_ENV),
                      ({RETRY_AFTER_ENV: "auto"}, RETRY_AFTER_ENV)):
        with pytest.raises(ValueError, match=name):
            settings_from_env(env)
    with pytest.raises(ValueError, match="max_in_flight"):
        ProxyAdmission(HeldApp(), max_in_flight=0)


class AnnouncingApp:
    """Generation responses announce ``limits[i]`` from Ingress token ``i`` in turn."""

    def __init__(self, announcements: list[bytes]) -> None:
        self.announcements = list(announcements)
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, scope, receive, send):
        await self.release.wait()
        headers = [(b"content-type", b"application/json")]
        if self.announcements:
            headers.append((LIMIT_HEADER, self.announcements.pop(0)))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})


def test_without_a_fixed_limit_it_follows_the_ingress_replicas_announcements():
    now = [0.0]

    async def main():
        app = AnnouncingApp([b"aaa 3", b"bbb 2", b"junk", b"aaa 3", b"bbb 0"])
        proxy = ProxyAdmission(app, clock=lambda: now[0], learn_window_s=10.0)
        assert proxy.limit is None  # nothing heard: no limit, the Ingress decides
        status, headers, _ = await call(proxy, "/generate")
        assert status == 200 and "x-kvroute-admission-limit" not in headers  # taken off for the client
        assert proxy.limit == 3
        await call(proxy, "/generate")
        assert proxy.limit == 5  # two Ingress replicas: their limits add up
        await call(proxy, "/generate")  # an announcement it cannot read changes nothing
        assert proxy.limit == 5
        app.release.clear()
        held = [asyncio.create_task(call(proxy, "/generate")) for _ in range(5)]
        await asyncio.sleep(0.01)
        probe = asyncio.create_task(call(proxy, "/generate"))  # past the limit: one probe goes on to the Ingress
        await asyncio.sleep(0.01)
        assert not probe.done() and proxy.admission.num_in_flight == 6
        status, headers, body = await call(proxy, "/v1/completions")  # within the probe period: refused here
        assert status == 429 and headers["x-kvroute-refused-by"] == "proxy" and b"5 requests" in body
        now[0] = 0.3  # a probe period later, the next one goes on too
        second_probe = asyncio.create_task(call(proxy, "/generate"))
        await asyncio.sleep(0.01)
        assert proxy.admission.num_in_flight == 7 and (await call(proxy, "/generate"))[0] == 429
        held += [probe, second_probe]
        app.release.set()
        await asyncio.gather(*held)  # their announcements: aaa 3, then bbb's admission off (the rest: none)
        assert proxy.limit is None  # an Ingress replica without admission: the proxy refuses nothing
        now[0] = 11.0  # neither heard from within the window: both forgotten
        app.announcements.append(b"aaa 3")
        await call(proxy, "/generate")
        assert proxy.limit == 3
        return proxy

    proxy = asyncio.run(main())
    assert proxy.admission.num_in_flight == 0


def test_a_fixed_limit_ignores_announcements_sends_no_probe_and_still_takes_them_off():
    async def main():
        app = AnnouncingApp([b"aaa 50"])
        proxy = ProxyAdmission(app, max_in_flight=1)
        status, headers, _ = await call(proxy, "/generate")
        app.release.clear()
        held = asyncio.create_task(call(proxy, "/generate"))
        await asyncio.sleep(0.01)
        over = await call(proxy, "/generate")  # no probe past a limit the operator fixed
        app.release.set()
        await held
        return proxy, status, headers, over[0]

    proxy, status, headers, over = asyncio.run(main())
    assert status == 200 and "x-kvroute-admission-limit" not in headers and proxy.limit == 1 and over == 429


def test_the_ingress_announces_its_token_and_limit_on_every_generation_response():
    from deploy.admission import Admission, AdmissionGuard

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        admission = Admission(max_in_flight_per_worker=1, num_workers=2)
        guard = AdmissionGuard(ok, admission, retry_after_s=1)
        answers = await asyncio.gather(*(call(guard, "/generate") for _ in range(3)))
        off = AdmissionGuard(ok, Admission(max_in_flight_per_worker=0), retry_after_s=1)
        return answers, await call(off, "/v1/completions"), await call(guard, "/health", method="GET")

    answers, off, health = asyncio.run(main())
    assert sorted(status for status, *_ in answers) == [200, 200, 429]
    tokens = {headers["x-kvroute-admission-limit"].split()[0] for _, headers, _ in answers}
    assert len(tokens) == 1  # one guard, one token, on admitted and refused answers alike
    assert all(headers["x-kvroute-admission-limit"].split()[1] == "2" for _, headers, _ in answers)
    assert off[0] == 200 and off[1]["x-kvroute-admission-limit"].endswith(" 0")
    assert "x-kvroute-admission-limit" not in health[1]


def test_the_proxy_callback_installs_the_middleware_only_when_a_limit_is_set(monkeypatch):
    from starlette.middleware import Middleware

    from ray.serve._private.http_util import validate_http_proxy_callback_return

    module, _, function = CALLBACK.partition(":")
    assert (module, function) == ("deploy.proxy_admission", "middlewares")
    monkeypatch.setenv(MAX_IN_FLIGHT_ENV, "0")
    assert middlewares() == []
    monkeypatch.delenv(MAX_IN_FLIGHT_ENV)
    (following,) = validate_http_proxy_callback_return(middlewares())
    assert following.cls is ProxyAdmission and following.kwargs["max_in_flight"] is None
    monkeypatch.setenv(MAX_IN_FLIGHT_ENV, "12")
    monkeypatch.setenv(RETRY_AFTER_ENV, "2")
    installed = validate_http_proxy_callback_return(middlewares())  # what Serve's proxy checks it with
    assert len(installed) == 1 and isinstance(installed[0], Middleware) and installed[0].cls is ProxyAdmission
    assert (installed[0].kwargs["max_in_flight"], installed[0].kwargs["retry_after_s"]) == (12, 2)


def test_the_ingress_announces_no_limit_until_it_has_counted_the_workers():
    """At start-up the Ingress guesses one Worker and recounts before refusing;
    a front that took the guess for the limit would refuse what the Ingress admits."""
    from deploy.admission import Admission, AdmissionGuard

    counts = iter([0, 2])

    async def count_workers():
        return next(counts, 2)

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        guard = AdmissionGuard(ok, Admission(max_in_flight_per_worker=3), retry_after_s=1,
                               count_workers=count_workers, refresh_period_s=30.0)
        first = await call(guard, "/generate")  # no Worker has posted yet: the count reads 0
        await asyncio.sleep(0.3)  # STARTUP_REFRESH_S later the next request counts again
        await call(guard, "/generate")
        await asyncio.sleep(0.05)
        return first, await call(guard, "/generate")

    first, later = asyncio.run(main())
    assert first[1]["x-kvroute-admission-limit"].endswith(" 0")
    assert later[1]["x-kvroute-admission-limit"].endswith(" 6")

