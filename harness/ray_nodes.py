"""Several Ray nodes on this one machine, so KV transfers between Worker
replicas cross two raylets' object stores as they would on a real cluster
(issue 13, live).

Every node is its own raylet with its own object store, started with ``ray
start`` (the head with ``--head``, the others with ``--address`` of the
head's GCS), each on free ports of its own and a temp dir of its own under
the cluster's, so the owner of the cluster can stop exactly these processes.
Each node offers one unit of :data:`WORKER_SLOT` and the Worker deployment
asks for one, so Serve places at most one Worker replica per node: with as
many replicas as nodes, one on each. Nodes also carry ``kvroute_node_<i>``
(for tests that name a node). All nodes advertise 127.0.0.1; with several
nodes on one address only the head runs an HTTP proxy (one port 8000).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

WORKER_SLOT = "kvroute_worker_slot"


def node_resources(index: int) -> dict[str, float]:
    """Custom resources of node ``index`` (0 = head)."""
    return {WORKER_SLOT: 1.0, f"kvroute_node_{index}": 1.0}


def worker_node_command(ray_bin: str, head_address: str, temp_dir: str, index: int, free_port: Callable[[], int],
                        num_cpus: int | None = None, object_store_memory: int | None = None) -> list[str]:
    """``ray start`` joining node ``index`` (>= 1) to the head at ``head_address``,
    every port its own (two raylets share one machine)."""
    if index < 1:
        raise ValueError(f"a worker node's index starts at 1, got {index}")
    command = [
        ray_bin, "start", f"--address={head_address}", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
        f"--resources={json.dumps(node_resources(index))}", "--disable-usage-stats",
        f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
        f"--metrics-export-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
    ]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    if object_store_memory is not None:
        command.append(f"--object-store-memory={object_store_memory}")
    return command


def place_one_worker_per_node(config: dict) -> dict:
    """The Serve config with the Worker deployment asking for one
    :data:`WORKER_SLOT` (its other actor options kept) and the HTTP proxy on
    the head only. Changes ``config`` in place and returns it."""
    config["proxy_location"] = "HeadOnly"
    for application in config["applications"]:
        for deployment in application.get("deployments", []):
            if deployment["name"] == "Worker":
                options = deployment.setdefault("ray_actor_options", {})
                options["resources"] = {**options.get("resources", {}), WORKER_SLOT: 1.0}
    return config


_REPLICA_NODES_SCRIPT = """
import json, sys, ray
from ray.util.state import list_actors, list_nodes
ray.init(address=sys.argv[1], logging_level="ERROR")
alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10000)
         if a.class_name.endswith(":Worker")]
nodes = [n.node_id for n in list_nodes(filters=[("state", "=", "ALIVE")])]
print(json.dumps({"nodes": nodes, "worker_pid_to_node": {str(a.pid): a.node_id for a in alive}}))
"""


def replica_nodes(address: str, env: dict[str, str], cwd: str, timeout_s: float = 60.0) -> dict:
    """``{"nodes": [alive node ids], "worker_pid_to_node": {pid: node id}}``
    for the Worker replicas of the cluster at ``address`` (Ray's state API, in
    a child process so the caller never joins the cluster)."""
    done = subprocess.run([sys.executable, "-c", _REPLICA_NODES_SCRIPT, address], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout_s, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
