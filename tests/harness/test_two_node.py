"""Two Ray nodes on one machine (harness/ray_nodes.py): the config patch, and
live, one Worker replica per node and both nodes stopped on exit."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
import yaml

from harness.ray_nodes import WORKER_SLOT, place_one_worker_per_node, worker_node_command
from harness.serving import REPO_ROOT, ServeApp, _alive


def test_the_worker_asks_for_one_slot_and_keeps_its_other_options_and_only_the_head_proxies():
    config = yaml.safe_load((REPO_ROOT / "deploy/config.yaml").read_text())
    before = {d["name"]: d for d in config["applications"][0]["deployments"]}
    cpus = before["Worker"]["ray_actor_options"]["num_cpus"]
    ingress_options = dict(before["Ingress"]["ray_actor_options"])
    patched = place_one_worker_per_node(config)
    after = {d["name"]: d for d in patched["applications"][0]["deployments"]}
    assert after["Worker"]["ray_actor_options"] == {"num_cpus": cpus, "resources": {WORKER_SLOT: 1.0}}
    assert after["Ingress"]["ray_actor_options"] == ingress_options
    assert patched["proxy_location"] == "HeadOnly"


def test_a_worker_node_gets_ports_of_its_own_and_joins_the_head():
    ports = itertools.count(20000)
    command = worker_node_command("ray", "127.0.0.1:6379", "/tmp/x/node1", 1, lambda: next(ports), num_cpus=2)
    assert command[:3] == ["ray", "start", "--address=127.0.0.1:6379"] and "--head" not in command
    port_flags = [c for c in command if c.split("=")[0].endswith("-port")]
    assert len(port_flags) == 6 and len({c.split("=")[1] for c in port_flags}) == 6
    resources = json.loads(next(c for c in command if c.startswith("--resources=")).split("=", 1)[1])
    assert resources == {WORKER_SLOT: 1.0, "kvroute_node_1": 1.0}
    assert "--num-cpus=2" in command and "--temp-dir=/tmp/x/node1" in command
    with pytest.raises(ValueError):
        worker_node_command("ray", "127.0.0.1:6379", "/tmp/x", 0, lambda: next(ports))
    with pytest.raises(ValueError):
        ServeApp(num_nodes=2, address="127.0.0.1:6379")


@pytest.mark.ray
def test_two_nodes_host_one_worker_each_and_stop_together():
    app = ServeApp(num_nodes=2, num_cpus=2, object_store_memory=256 * 2**20, ready_timeout_s=150)
    with app:
        app.deploy()
        placement = app.replica_nodes()
        stats = httpx.get(f"{app.url}/stats", timeout=10, trust_env=False).json()["replicas"]
        out = httpx.post(f"{app.url}/generate", json={"prompt_token_ids": list(range(40, 90)), "max_new_tokens": 2},
                         timeout=60, trust_env=False)
        pids = app.ray_pids()
    assert len(placement["nodes"]) == 2
    worker_nodes = placement["worker_pid_to_node"]
    assert len(worker_nodes) == 2 and set(worker_nodes.values()) == set(placement["nodes"])
    assert {str(s["pid"]) for s in stats.values()} == set(worker_nodes)
    assert out.status_code == 200 and len(out.json()["token_ids"]) == 2
    assert pids and not any(_alive(pid) for pid in pids)
