"""The app with Ray Serve's direct ingress (Ray 2.60, experimental): the
Ingress replica runs its own HTTP server, so a request reaches kvroute's
admission (deploy/admission.py) without crossing Serve's proxy and a Ray
call — a refusal costs the replica's HTTP parsing and the guard, nothing more.

Serve reads ``RAY_SERVE_ENABLE_DIRECT_INGRESS`` in each process at import.
Set for the Ingress replica alone (its ``runtime_env``, :data:`INGRESS_ENV`,
as deploy/config.yaml documents), the replica starts its own server on a
port the controller hands out from ``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT``
.. ``MAX_HTTP_PORT`` (lowest free first: with one Ingress replica, the
minimum; Serve's default range is 30000-31000), while Serve's proxy keeps
answering on ``http_options.port`` through Ray as before. The range is read
by the controller, so it is set for ``ray start`` (the whole cluster).
:class:`DirectIngressApp` picks a free range of its own and, once the app is
ready through the proxy, points :attr:`url` at the replica's port.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import yaml

from harness.serving import ServeApp

PORT_RANGE = 16
# The Ingress replica's env for direct ingress (deploy/config.yaml, commented):
# its own HTTP server; its user code on the replica's own event loop (Serve
# runs it on a second thread and loop by default: every request crosses
# between the two); held open 2 s when it drains (Serve's default is 30 s,
# for an external load balancer to deregister it; raise it behind one).
INGRESS_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
               "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def free_port_range(size: int = PORT_RANGE, first: int = 30000, last: int = 60000) -> int:
    """The first port of ``size`` consecutive ports none of which is bound on
    127.0.0.1 now (scanned from ``first``)."""
    for base in range(first, last, size):
        if all(_is_free(port) for port in range(base, base + size)):
            return base
    raise RuntimeError(f"no {size} free consecutive ports in {first}..{last}")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class DirectIngressApp(ServeApp):
    """A :class:`ServeApp` whose cluster runs Serve's direct ingress; after
    :meth:`deploy`, :attr:`url` is the Ingress replica's own server."""

    def __init__(self, *args, ingress_env: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ingress_env = dict(INGRESS_ENV if ingress_env is None else ingress_env)
        self.direct_port_base = free_port_range()
        self.direct_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.direct_port or self.http_port}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _env(self) -> dict[str, str]:
        env = super()._env()
        env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(self.direct_port_base)
        env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(self.direct_port_base + PORT_RANGE - 1)
        return env

    def write_config(self, *args, **kwargs) -> str:
        """The patched config, the Ingress replica given :attr:`ingress_env`."""
        path = super().write_config(*args, **kwargs)
        config = yaml.safe_load(Path(path).read_text())
        for deployment in config["applications"][0].get("deployments", []):
            if deployment["name"] == "Ingress":
                options = deployment.setdefault("ray_actor_options", {})
                env_vars = options.setdefault("runtime_env", {}).setdefault("env_vars", {})
                env_vars.update(self.ingress_env)
        Path(path).write_text(yaml.safe_dump(config))
        return path

    def wait_ready(self) -> None:
        self.direct_port = None  # readiness through the proxy first, then find the replica's port
        super().wait_ready()
        self.direct_port = self.find_direct_port()

    def find_direct_port(self, timeout_s: float = 30.0) -> int:
        """The port in this app's range whose server answers ``/health``."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for port in range(self.direct_port_base, self.direct_port_base + PORT_RANGE):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                        return port
                except httpx.HTTPError:
                    continue
            time.sleep(0.5)
        raise TimeoutError(f"no direct-ingress server answered /health on ports {self.direct_port_base}.."
                           f"{self.direct_port_base + PORT_RANGE - 1}")
