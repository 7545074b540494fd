"""The worker engine: a Hugging Face causal LM on a paged KV pool with radix
prefix reuse and continuous batching (see README.md for the module map).

Importing ``worker`` is cheap; torch and transformers load with the first
engine class touched.
"""

from __future__ import annotations

_EXPORTS = {
    "EngineConfig": "worker.config",
    "SamplingParams": "worker.sampling",
    "GenerationResult": "worker.results",
    "TokenEvent": "worker.results",
    "Engine": "worker.engine",
    "AsyncEngine": "worker.async_engine",
    "EngineOverloaded": "worker.results",
    "TinyLlamaSpec": "worker.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
