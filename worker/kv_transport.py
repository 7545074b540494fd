"""Ray adapter for fetching a prefix (worker/kv_fetch.py): the call to the
owner and the start-up bandwidth probe.

:class:`ServePeerTransport` calls ``export_prefix`` on the replica's own
deployment through a Serve handle. The request is an
:class:`~worker.messages.ExportRequest`; ``router/serve.py`` routes it to its
``target_replica`` only (to any replica when the target is gone, which then
answers at once with no bundle). The bundle is the call's return value, so
Ray moves it through its object store: shared memory on one node, the object
manager across nodes; the ingress never sees it. Each call is a Serve
request of its own (``deploy.ray_client.own_call``): inherited from the
request being served, one request's id would be shared by the fetches of a
batch's items, and our router would fulfil only one of them.
"""

from __future__ import annotations

import time

import ray
import torch
from ray import serve

from deploy.ray_client import own_call
from worker.messages import ExportReply, ExportRequest


class ServePeerTransport:
    """``app_name`` / ``deployment_name``: the Worker deployment this replica belongs to."""

    def __init__(self, app_name: str, deployment_name: str) -> None:
        self._app_name = app_name
        self._deployment_name = deployment_name
        self._handle = None  # made on first use: a replica's constructor cannot wait for the controller

    async def fetch(self, request: ExportRequest) -> ExportReply:
        if self._handle is None:
            self._handle = serve.get_deployment_handle(self._deployment_name, self._app_name)
        response = own_call(self._handle.export_prefix, request)
        try:
            return await response
        except BaseException:  # cancelled (timeout, client gone) or failed: stop the owner's work too
            response.cancel()
            raise


def probe_bandwidth(num_bytes: int) -> float:
    """Bytes per second of a ``ray.put`` + ``ray.get`` of ``num_bytes`` as a
    bundle's rows travel (one flat NumPy byte array, ``KVBundle.__reduce__``)
    through this node's object store, reading every byte on arrival: the
    estimate until real fetches refine it (they also pay the call to the
    owner and, across nodes, the network)."""
    rows = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32).view(torch.uint8).numpy()
    ray.get(ray.put(rows[:1]))  # the first put sets up the store client
    start = time.perf_counter()
    got = ray.get(ray.put(rows))
    got.copy()  # read every page (a get maps them lazily), as an import copies the rows into its pool
    return rows.nbytes / max(time.perf_counter() - start, 1e-9)
