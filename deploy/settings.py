"""The serving app's configuration: one frozen record built from the Serve
config's ``args`` (deploy/config.yaml), validated up front.

Only deploy/ reads YAML, env or flags; everything below receives plain values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

ROUTERS = {
    "kvroute": "router.serve:KVRouteRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "prefix_affinity": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
    ),
}


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits enforced at the edge (4xx beyond them)."""

    max_prompt_tokens: int = 4096
    max_new_tokens: int = 1024
    max_body_bytes: int = 1 << 20  # 1 MiB
    max_batch_prompts: int = 256
    max_n: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"limits.{f.name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class AppConfig:
    """Everything ``build_app`` needs.

    ``engine``: keyword arguments for ``worker.EngineConfig`` (validated there).
    ``router``: a key of :data:`ROUTERS` or an import path of a RequestRouter.
    ``router_block_size``: tokens per hashed block for routing; the ingress and
    every worker's cache summary use this one value, so hashes agree.
    ``api_keys``: when non-empty, requests need ``Authorization: Bearer <key>``.
    """

    model: str = "tiny-llama"
    served_model_name: str | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    router: str = "kvroute"
    router_kwargs: Mapping[str, Any] = field(default_factory=dict)
    router_block_size: int = 64
    routing_stats_period_s: float = 1.0
    stats_period_s: float = 1.0
    limits: Limits = field(default_factory=Limits)
    api_keys: tuple[str, ...] = ()
    retry_after_s: int = 1
    body_timeout_s: float = 15.0  # a request body must arrive within this (else 408)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if type(self.router_block_size) is not int or self.router_block_size <= 0:
            raise ValueError(f"router_block_size must be a positive int, got {self.router_block_size!r}")
        for name in ("routing_stats_period_s", "stats_period_s", "body_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.router, str) or not self.router:
            raise ValueError(f"router must be a name or import path, got {self.router!r}")
        if any(not isinstance(key, str) or not key for key in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")

    @property
    def model_name(self) -> str:
        """The id clients put in the OpenAI ``model`` field."""
        return self.served_model_name or self.model

    @property
    def router_class_path(self) -> str:
        return ROUTERS.get(self.router, self.router)

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> AppConfig:
        """Build from the Serve config's ``args`` mapping; unknown keys are errors."""
        args = dict(args or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown app args {unknown}; known: {sorted(known)}")
        if "limits" in args:
            limits = args["limits"]
            if not isinstance(limits, Mapping):
                raise ValueError(f"limits must be a mapping, got {limits!r}")
            args["limits"] = Limits(**limits)
        if "api_keys" in args:
            keys = args["api_keys"] or ()
            args["api_keys"] = (keys,) if isinstance(keys, str) else tuple(keys)
        for name in ("engine", "router_kwargs"):
            if name in args and not isinstance(args[name] or {}, Mapping):
                raise ValueError(f"{name} must be a mapping, got {args[name]!r}")
            if name in args:
                args[name] = dict(args[name] or {})
        return cls(**args)
