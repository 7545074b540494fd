"""Bring the app up and down exactly as the README does, from Python.

``ray start --head`` → ``serve run --non-blocking CONFIG`` → wait until
``/health`` answers and every Worker replica is running → ... →
``serve shutdown -y`` → stop the Ray processes *this object started* (by
their session directory, never a broad ``ray stop``, so other Ray clusters on
the machine are left alone). Used by the load test and the integration tests.

``num_nodes=2`` starts a second Ray node on this machine joined to the head
(harness/ray_nodes.py): one Worker replica per node, so KV fetched between
replicas crosses two object stores; both nodes stop with the cluster.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from harness.cluster_processes import cli_path, is_alive, pids_mentioning
from harness.ray_nodes import node_resources, place_one_worker_per_node, replica_nodes, worker_node_command

REPO_ROOT = Path(__file__).resolve().parent.parent
_alive = is_alive  # its name here before harness/cluster_processes.py (tests import it)


_PORTS_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now and never returned before by this process.

    The OS may hand the same ephemeral port to two ``bind(0)`` calls in a row
    once the first socket is closed; a ``ray start`` given one port twice
    (e.g. dashboard and client server) fails, so each port is handed out once.
    """
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _PORTS_HANDED_OUT:
            _PORTS_HANDED_OUT.add(port)
            return port
    raise RuntimeError("no fresh free port after 1000 tries")


class ServeRunFailed(RuntimeError):
    """``serve run`` itself failed (the cluster's Serve did not start or take
    the config); the message carries its output and Serve's logs."""


class ServeApp:
    """A Serve deployment of ``config_path`` on a Ray cluster.

    ``address``: an existing cluster (e.g. ``"127.0.0.1:6379"``); when None a
    private head node is started on free ports and stopped on exit.
    ``args_overrides`` / ``deployment_overrides`` patch the config's app args
    and per-deployment options (e.g. ``{"Worker": {"num_replicas": 3}}``).
    ``num_nodes``: Ray nodes to start on this machine (only without
    ``address``); with more than one, each Worker replica asks for a node's
    one worker slot, so there is at most one per node. ``object_store_memory``:
    bytes per node's object store (None: Ray's default). ``cluster_env``:
    environment variables for ``ray start`` and the serve CLI, which every
    process of the cluster inherits (Serve's proxy reads its callbacks from
    there, e.g. :func:`deploy.proxy_admission.environment`).
    """

    def __init__(
        self,
        config_path: str | Path = "deploy/config.yaml",
        *,
        address: str | None = None,
        http_port: int | None = None,
        num_cpus: int | None = None,
        args_overrides: dict | None = None,
        deployment_overrides: dict | None = None,
        ready_timeout_s: float = 240.0,
        num_nodes: int = 1,
        object_store_memory: int | None = None,
        cluster_env: dict[str, str] | None = None,
    ) -> None:
        if type(num_nodes) is not int or num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
        if num_nodes > 1 and address is not None:
            raise ValueError("num_nodes > 1 starts its own cluster: pass no address")
        self.config_path = (REPO_ROOT / config_path) if not Path(config_path).is_absolute() else Path(config_path)
        self.address = address
        self.http_port = http_port or (8000 if address else free_port())
        self.num_cpus = num_cpus
        self.args_overrides = dict(args_overrides or {})
        self.deployment_overrides = dict(deployment_overrides or {})
        self.ready_timeout_s = ready_timeout_s
        self.num_nodes = num_nodes
        self.object_store_memory = object_store_memory
        self.cluster_env = dict(cluster_env or {})
        self.dashboard_port: int | None = None
        self._temp_dir: str | None = None
        self._started_ray = False
        self._config_file: str | None = None
        self._closed = False
        self._auth_token = secrets.token_hex(32)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    # ---------------------------------------------------------------- cluster
    def __enter__(self) -> ServeApp:
        if self.address is None:
            self._start_ray()
        return self

    def __exit__(self, *exc) -> None:
        """Idempotent: shut the app down, then stop the cluster if we started it."""
        if self._closed:
            return
        self._closed = True
        try:
            self.shutdown_app(drain=False)  # the work is over: nothing to wait for
        finally:
            if self._started_ray:
                self.stop_ray()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["RAY_ADDRESS"] = self.address
        # ray 2.60's `ray start` turns on token auth; its clients (the serve CLI)
        # must opt in too, reading the token from ~/.ray/auth_token.
        env.setdefault("RAY_AUTH_MODE", "token")
        if env["RAY_AUTH_MODE"] == "token" and not _has_ray_token(env):
            # A fresh machine has no ~/.ray/auth_token: give the cluster we
            # start its own token (inherited by ray start, serve and workers).
            env["RAY_AUTH_TOKEN"] = self._auth_token
        if self.dashboard_port:
            env["RAY_DASHBOARD_ADDRESS"] = f"http://127.0.0.1:{self.dashboard_port}"
        env.update(self.cluster_env)
        return env

    def _start_ray(self, attempts: int = 3) -> None:
        """Start the head (and any extra nodes) on fresh free ports.

        A port free when picked can be taken by another process before Ray
        binds it; a failed start is stopped and retried on new ports."""
        for attempt in range(1, attempts + 1):
            try:
                self._start_ray_once()
                return
            except subprocess.CalledProcessError as error:
                self.stop_ray()
                if attempt == attempts:
                    raise RuntimeError(f"ray start failed {attempts} times; last stderr:\n{error.stderr}") from error

    def _start_ray_once(self) -> None:
        self._temp_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
        gcs_port, self.dashboard_port = free_port(), free_port()
        command = [
            cli_path("ray"), "start", "--head", f"--port={gcs_port}", f"--dashboard-port={self.dashboard_port}",
            f"--temp-dir={self._temp_dir}", "--include-dashboard=true", "--disable-usage-stats",
            f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        ]
        if self.num_cpus is not None:
            command.append(f"--num-cpus={self.num_cpus}")
        if self.object_store_memory is not None:
            command.append(f"--object-store-memory={self.object_store_memory}")
        if self.num_nodes > 1:
            command += ["--node-ip-address=127.0.0.1", f"--resources={json.dumps(node_resources(0))}"]
        self.address = f"127.0.0.1:{gcs_port}"
        self._started_ray = True
        subprocess.run(command, check=True, capture_output=True, text=True, env=self._env(), timeout=120)
        for index in range(1, self.num_nodes):
            node_dir = os.path.join(self._temp_dir, f"node{index}")
            os.makedirs(node_dir)
            subprocess.run(worker_node_command(cli_path("ray"), self.address, node_dir, index, free_port, self.num_cpus,
                                               self.object_store_memory),
                           check=True, capture_output=True, text=True, env=self._env(), timeout=120)

    def stop_ray(self) -> None:
        """Stop the processes of the cluster this object started, and only those."""
        if not self._temp_dir:
            return
        pids = pids_mentioning(self._temp_dir)
        # The GCS and the dashboard take >15 s to honour SIGTERM; the app is
        # already shut down and the session dir is private, so 3 s is plenty.
        for sig, grace_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + grace_s
            while time.time() < deadline and any(is_alive(pid) for pid in pids):
                time.sleep(0.2)
            pids = [pid for pid in pids if is_alive(pid)]
            if not pids:
                break
        self._started_ray = False
        if not os.environ.get("KVROUTE_KEEP_RAY_DIR"):  # set it to read the session's logs afterwards
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def ray_pids(self) -> list[int]:
        return pids_mentioning(self._temp_dir) if self._temp_dir else []

    def replica_nodes(self) -> dict:
        """Alive Ray nodes and the node of each Worker replica (by its PID)."""
        return replica_nodes(self.address, self._env(), str(REPO_ROOT))

    # -------------------------------------------------------------------- app
    def write_config(self, router: str | None = None, router_kwargs: dict | None = None,
                     app_args: dict | None = None, deployments: dict | None = None) -> str:
        """The patched config in a temp file: ``args_overrides``, then this
        deployment's ``app_args`` (e.g. ``{"fetch_enabled": False}``), then
        ``router`` / ``router_kwargs`` (another router than kvroute without
        kwargs of its own gets none: the config's are kvroute's), then the deployment overrides, then
        this deployment's ``deployments`` (e.g. ``{"Ingress": {"num_replicas":
        2}}``), and one Worker per node when there are several nodes."""
        config = yaml.safe_load(self.config_path.read_text())
        config.setdefault("http_options", {})
        config["http_options"].update({"host": "127.0.0.1", "port": self.http_port})
        app = config["applications"][0]
        app.setdefault("args", {}).update(self.args_overrides)
        app["args"].update(app_args or {})
        if router is not None:
            app["args"]["router"] = router
            if router_kwargs is None and router != "kvroute":
                app["args"].pop("router_kwargs", None)  # the config's are the kvroute router's knobs
        if router_kwargs is not None:
            app["args"]["router_kwargs"] = router_kwargs
        for deployment in app.get("deployments", []):
            deployment.update(self.deployment_overrides.get(deployment["name"], {}))
            deployment.update((deployments or {}).get(deployment["name"], {}))
        if self.num_nodes > 1:
            place_one_worker_per_node(config)
        handle, path = tempfile.mkstemp(prefix="kvroute-", suffix=".yaml")
        with os.fdopen(handle, "w") as file:
            yaml.safe_dump(config, file)
        self._config_file = path
        return path

    def deploy(self, router: str | None = None, router_kwargs: dict | None = None,
               app_args: dict | None = None, deployments: dict | None = None) -> None:
        """``serve run --non-blocking`` the (patched) config; wait until ready."""
        path = self.write_config(router, router_kwargs, app_args, deployments)
        result = subprocess.run(
            [cli_path("serve"), "run", "--non-blocking", "--address", self.address, path],
            capture_output=True, text=True, env=self._env(), cwd=REPO_ROOT, timeout=300,
        )
        if result.returncode != 0:
            raise ServeRunFailed(f"serve run exited {result.returncode}; its output:\n{result.stdout[-3000:]}\n"
                               f"{result.stderr[-3000:]}\nServe's logs:\n{self.serve_log_tail()}")
        self.wait_ready()

    def serve_log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` of each of this cluster's Serve logs (what a failed start left)."""
        if not self._temp_dir:
            return ""
        return subprocess.run(f"tail -n {lines} {self._temp_dir}/session_latest/logs/serve/*.log", shell=True,
                              capture_output=True, text=True).stdout[-6000:]

    @property
    def auth_headers(self) -> dict[str, str]:
        """``Authorization`` for the deployed config's first API key ({} when none)."""
        if not self._config_file:
            return {}
        keys = yaml.safe_load(Path(self._config_file).read_text())["applications"][0].get("args", {}).get("api_keys")
        keys = [keys] if isinstance(keys, str) else list(keys or [])
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def wait_ready(self) -> None:
        deadline = time.time() + self.ready_timeout_s
        num_workers = self.expected_workers()
        headers = self.auth_headers
        last = None
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5, trust_env=False).status_code == 200:
                    stats = httpx.get(f"{self.url}/stats", headers=headers, timeout=10, trust_env=False).json()
                    last = stats
                    if len(stats.get("replicas", {})) >= num_workers:
                        return
            except httpx.HTTPError as error:
                last = error
            time.sleep(1.0)
        raise TimeoutError(f"app not ready after {self.ready_timeout_s}s: {last!r}")

    def expected_workers(self) -> int:
        config = yaml.safe_load(Path(self._config_file).read_text())
        for deployment in config["applications"][0].get("deployments", []):
            if deployment["name"] == "Worker":
                return int(deployment.get("num_replicas", 1))
        return 1

    def drain_app(self, timeout_s: float = 120.0) -> None:
        """Delete the application while Serve's HTTP proxies stay up, so requests
        in flight finish (each replica waits for its ongoing requests, up to its
        ``graceful_shutdown_timeout_s``) and new ones get 404. ``serve
        shutdown`` alone kills the proxies at once, cutting open connections."""
        if self.address is None or not self._config_file:
            return
        name = yaml.safe_load(Path(self._config_file).read_text())["applications"][0]["name"]
        script = ("import ray, sys; from ray import serve; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                  "serve.delete(sys.argv[2])")
        subprocess.run([sys.executable, "-c", script, self.address, name], capture_output=True, text=True,
                       env=self._env(), cwd=REPO_ROOT, timeout=timeout_s)

    def shutdown_app(self, drain: bool = True) -> None:
        """``serve shutdown -y``, after draining the app unless ``drain`` is False."""
        if self.address is None:
            return
        if drain:
            self.drain_app()
        subprocess.run([cli_path("serve"), "shutdown", "-y"], capture_output=True, text=True, env=self._env(),
                       cwd=REPO_ROOT, timeout=120)
        if self._config_file and os.path.exists(self._config_file):
            os.unlink(self._config_file)
            self._config_file = None


def _has_ray_token(env: dict[str, str]) -> bool:
    """Whether Ray's token auth finds a token in ``env`` or its token file."""
    if env.get("RAY_AUTH_TOKEN"):
        return True
    path = env.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return os.path.isfile(path)


class ProxyAdmissionApp(ServeApp):
    """A :class:`ServeApp` whose Serve proxy runs kvroute's admission
    (deploy/proxy_admission.py, following the Ingress's limit) unless the
    caller's ``cluster_env`` says otherwise."""

    def __init__(self, *args, cluster_env: dict[str, str] | None = None, **kwargs) -> None:
        from deploy.proxy_admission import environment

        super().__init__(*args, cluster_env={**environment(), **(cluster_env or {})}, **kwargs)


def ingress_app_class() -> type[ServeApp]:
    """The front the README's command 1 runs, :class:`ProxyAdmissionApp`
    (``KVROUTE_INGRESS`` unset or ``proxy-admission``); plain
    :class:`ServeApp` with ``proxy``; the HAProxy-ingress one with ``haproxy``."""
    kind = os.environ.get("KVROUTE_INGRESS", "proxy-admission")
    if kind == "haproxy":
        from harness.haproxy_ingress import HAProxyApp

        return HAProxyApp
    if kind == "proxy-admission":
        return ProxyAdmissionApp
    if kind != "proxy":
        raise ValueError(f"KVROUTE_INGRESS must be 'proxy', 'haproxy' or 'proxy-admission', got {kind!r}")
    return ServeApp


def start_app(config_path: str | Path = "deploy/config.yaml", **overrides) -> ServeApp:
    """A started and deployed :class:`ServeApp` (the caller ``__exit__``s it);
    on failure everything is stopped and the error carries the Serve logs.

    By default Serve's Python proxy runs kvroute's admission, as the README's
    command 1 sets up (:func:`ingress_app_class`); ``KVROUTE_INGRESS=proxy``
    runs it without, ``KVROUTE_INGRESS=haproxy`` behind Serve's HAProxy
    ingress (harness/haproxy_ingress.py)."""
    app = ingress_app_class()(config_path, **overrides)
    app.__enter__()
    try:
        app.deploy()
    except Exception as error:
        logs = "" if isinstance(error, ServeRunFailed) else app.serve_log_tail()  # a failed serve run carries its own
        app.__exit__(None, None, None)
        raise RuntimeError(f"app failed to start: {error}\n{logs}") from error
    return app


def config_engine_args(config_path: str | Path = "deploy/config.yaml", **changes) -> dict:
    """The config file's ``engine`` args with ``changes`` applied."""
    path = (REPO_ROOT / config_path) if not Path(config_path).is_absolute() else Path(config_path)
    engine = dict(yaml.safe_load(path.read_text())["applications"][0]["args"]["engine"])
    engine.update(changes)
    return engine
