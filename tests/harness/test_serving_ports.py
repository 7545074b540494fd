"""The harness's cluster start-up: ports are never handed out twice; a
``ray start`` that fails (a port taken between pick and bind) is retried on
fresh ports after the failed attempt is stopped; a failed ``serve run`` says
why, and the HAProxy app retries it once on a fresh cluster and ports."""

import subprocess

import pytest

from harness.haproxy_ingress import HAProxyApp
from harness.serving import ServeApp, ServeRunFailed, free_port


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


def test_a_failed_serve_run_raises_with_its_output(monkeypatch, tmp_path):
    app = ServeApp()
    app.address = "127.0.0.1:1"
    failed = subprocess.CompletedProcess(["serve"], 1, stdout="Running config file", stderr="HAProxy crashed: bind")
    monkeypatch.setattr(app, "write_config", lambda *args: str(tmp_path / "config.yaml"))
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(ServeRunFailed, match="(?s)exited 1.*HAProxy crashed: bind"):
        app.deploy()


def _haproxy_app_whose_serve_run_fails(times: int, monkeypatch) -> tuple[HAProxyApp, list]:
    app = HAProxyApp()
    app._started_ray = True
    calls: list = []

    def deploy_once(self, *args, **kwargs):
        calls.append(("deploy", self.http_port, dict(self.ports)))
        if sum(call[0] == "deploy" for call in calls) <= times:
            raise ServeRunFailed("serve run exited 1; HAProxy did not take over the admin socket")

    monkeypatch.setattr(ServeApp, "deploy", deploy_once)
    monkeypatch.setattr(app, "stop_ray", lambda: calls.append(("stop",)))
    monkeypatch.setattr(app, "_start_ray", lambda: calls.append(("start",)))
    return app, calls


def test_haproxy_app_retries_a_failed_serve_run_once_on_a_fresh_cluster_and_ports(monkeypatch):
    app, calls = _haproxy_app_whose_serve_run_fails(1, monkeypatch)
    with pytest.warns(UserWarning, match="admin socket"):
        app.deploy()
    assert [call[0] for call in calls] == ["deploy", "stop", "start", "deploy"]
    first, second = calls[0], calls[3]
    assert first[1] != second[1] and set(first[2].values()).isdisjoint(second[2].values())


def test_haproxy_app_raises_a_second_serve_run_failure(monkeypatch):
    app, calls = _haproxy_app_whose_serve_run_fails(2, monkeypatch)
    with pytest.warns(UserWarning), pytest.raises(ServeRunFailed):
        app.deploy()
    assert [call[0] for call in calls] == ["deploy", "stop", "start", "deploy"]


def test_haproxy_app_on_a_cluster_it_did_not_start_does_not_retry(monkeypatch):
    app, calls = _haproxy_app_whose_serve_run_fails(1, monkeypatch)
    app._started_ray = False
    with pytest.raises(ServeRunFailed):
        app.deploy()
    assert [call[0] for call in calls] == ["deploy"]
