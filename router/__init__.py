"""Prefix-affinity router: pure core (ring, prefix index, load, policy,
simulator) and the thin Ray Serve adapter in ``router/serve.py`` (the only
module here that imports ray; import it by path, not from this package)."""

from router.load import LoadTracker
from router.policy import PolicyConfig, PrefixAffinityPolicy
from router.prefix_index import PrefixIndex
from router.request import RoutingRequest
from router.ring import HashRing

__all__ = ["HashRing", "LoadTracker", "PolicyConfig", "PrefixAffinityPolicy", "PrefixIndex", "RoutingRequest"]
