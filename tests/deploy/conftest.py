"""A live app for the integration tests, brought up the way the README does:
``ray start --head``, ``serve run --non-blocking deploy/config.yaml``, then
``serve shutdown -y`` and stopping the Ray processes this run started."""

from __future__ import annotations

import subprocess

import pytest

from deploy.serving import ServeApp


def start_app(**overrides) -> ServeApp:
    app = ServeApp("deploy/config.yaml", **overrides)
    app.__enter__()
    try:
        app.deploy()
    except Exception as error:
        logs = ""
        if app._temp_dir:
            logs = subprocess.run(
                f"tail -n 40 {app._temp_dir}/session_latest/logs/serve/*.log", shell=True, capture_output=True, text=True
            ).stdout
        stderr = getattr(error, "stderr", "") or ""
        app.__exit__(None, None, None)
        raise RuntimeError(f"app failed to start: {error}\n{stderr[-3000:]}\n{logs[-6000:]}") from error
    return app


@pytest.fixture(scope="module")
def live_app():
    # Deterministic engines make outputs comparable bit for bit across
    # replicas, batches and cache hits; everything else is the README's config.
    app = start_app(args_overrides={"engine": _engine_args(deterministic=True)})
    yield app
    app.__exit__(None, None, None)


def _engine_args(**changes) -> dict:
    import yaml

    from deploy.serving import REPO_ROOT

    config = yaml.safe_load((REPO_ROOT / "deploy/config.yaml").read_text())
    engine = dict(config["applications"][0]["args"]["engine"])
    engine.update(changes)
    return engine
