"""What the ingress sends a Worker replica (crosses a process boundary).

Besides the generation inputs, each record carries the routing attributes the
request routers read from a request's first argument: ``block_hashes``,
``num_prompt_tokens``, ``salt``, ``token_ids`` (ours) and ``prompt`` (text, for Ray Serve
LLM's PrefixCacheAffinityRouter). ``prompt`` maps token ``t`` to the character
``chr(0x10000 + t)``: one character per token, so a character prefix is exactly
a token prefix and text-based routers see the same sharing we do.

``fetch`` is the router's :class:`router.fetch.FetchHint` for the replica it
chose (``router/serve.py`` sets it on the way out; the ingress never does).
:class:`ExportRequest` is what one Worker asks another for: the KV of a
cached prefix, routed only to ``target_replica`` (issue 13).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker import SamplingParams

if TYPE_CHECKING:
    from router.fetch import FetchHint
    from worker.kv_bundle import KVBundle

_TOKEN_CHAR_BASE = 0x10000


def tokens_as_text(token_ids: tuple[int, ...]) -> str:
    return "".join(chr(_TOKEN_CHAR_BASE + t) for t in token_ids)


@dataclass(frozen=True, slots=True)
class WorkerRequest:
    """One generation: prompt, sampling, tenant, and routing attributes."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    salt: str | None
    block_hashes: tuple[int, ...]  # chained, at the app's router_block_size, salted
    fetch: FetchHint | None = None  # set by the request router only: fetch this prefix from its owner

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Decode work the router adds to a replica's load (at most this many)."""
        return self.params.max_new_tokens

    @property
    def prompt(self) -> str:
        return tokens_as_text(self.prompt_token_ids)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The prompt, for the router's within-block match."""
        return self.prompt_token_ids


@dataclass(frozen=True, slots=True)
class WorkerBatch:
    """Requests sharing a prefix, sent to one replica so it computes the prefix
    once. Routed like its longest-common-prefix: the routing attributes are
    those of the shared part."""

    requests: tuple[WorkerRequest, ...]
    block_hashes: tuple[int, ...]
    shared_token_ids: tuple[int, ...]
    salt: str | None
    fetch: FetchHint | None = None  # as WorkerRequest.fetch, for the shared prefix

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def prompt(self) -> str:
        return tokens_as_text(self.shared_token_ids)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.shared_token_ids


@dataclass(frozen=True, slots=True)
class ExportRequest:
    """Worker → Worker: "send me the KV of the longest prefix of ``token_ids``
    (at most ``max_tokens``) you hold under ``salt``". The request router
    routes it to ``target_replica`` only (any replica when that one is gone,
    which then answers None at once: only the target exports).

    ``wait_s``: how long the owner may wait for more of that prefix that a
    sequence in its engine is still computing before it exports (a finite
    number >= 0, checked by the owner: ``PrefixFetcher.export``); 0, the
    default: export what is cached now."""

    target_replica: str
    token_ids: tuple[int, ...]
    salt: str | None
    max_tokens: int
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ExportReply:
    """The answer to an :class:`ExportRequest`: who answered, and the bundle
    (``None``: the answering replica is not the target, or holds none of it)."""

    replica_id: str
    bundle: KVBundle | None
