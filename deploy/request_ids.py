"""Request ids: unique across ingress replicas, processes and nodes.

A random uuid4 (122 random bits) per request: no coordination between
ingress replicas, and no collision between two processes that share a pid on
different nodes (the previous ``req-{pid}-{counter}`` did collide, and the
Worker answered the second request "already in flight")."""

from __future__ import annotations

import uuid


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
