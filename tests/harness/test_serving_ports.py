"""The harness's cluster start-up: ports are never handed out twice, and a
``ray start`` that fails (a port taken between pick and bind) is retried on
fresh ports after the failed attempt is stopped."""

import subprocess

import pytest

from harness.serving import ServeApp, free_port


def test_free_port_never_returns_a_port_twice_in_one_process():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def _app_whose_start_fails(times: int, monkeypatch) -> tuple[ServeApp, list[str]]:
    app = ServeApp()
    calls: list[str] = []

    def start_once():
        calls.append("start")
        if calls.count("start") <= times:
            raise subprocess.CalledProcessError(1, ["ray", "start"], stderr="address already in use")

    monkeypatch.setattr(app, "_start_ray_once", start_once)
    monkeypatch.setattr(app, "stop_ray", lambda: calls.append("stop"))
    return app, calls


def test_a_failed_ray_start_is_stopped_and_retried(monkeypatch):
    app, calls = _app_whose_start_fails(2, monkeypatch)
    app._start_ray(attempts=3)
    assert calls == ["start", "stop", "start", "stop", "start"]


def test_ray_start_gives_up_after_its_attempts_with_the_last_stderr(monkeypatch):
    app, calls = _app_whose_start_fails(5, monkeypatch)
    with pytest.raises(RuntimeError, match="address already in use"):
        app._start_ray(attempts=2)
    assert calls == ["start", "stop", "start", "stop"]
