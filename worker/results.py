"""What the engine hands back: per-token events and the final result; and
what a Worker replica hands the ingress for a batch item that failed.

All frozen: they cross the worker↔ingress process boundary as they are.
``replica_id`` is empty inside an engine; the Worker adapter stamps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One finished request.

    ``token_ids``: generated tokens (a stopping EOS / stop token included);
    ``logprobs``: their log-probabilities when requested, else ``None``;
    ``cached_tokens``: prompt tokens reused from the prefix cache when the
    request was first admitted (0 on a miss); ``ttft_s``: seconds from
    submission to the first generated token; ``replica_id``: the Worker
    replica that served it ("" inside an engine).

    Where the engine's time went (engine clock; None where unknown, e.g. a
    request that never reached a step): ``queue_s`` from submission until a
    step first took it (waiting for a batch slot or KV blocks), ``prefill_s``
    from then to the first token, ``decode_s`` from the first token to the
    last. ``queue_s + prefill_s = ttft_s``, and the three sum to the
    engine's whole time for the request; a preemption's wait and recompute
    count where they fall (in ``prefill_s`` before the first token, in
    ``decode_s`` after).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    prompt_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    ttft_s: float | None
    request_id: str = ""
    num_preemptions: int = 0
    replica_id: str = ""
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None

    @property
    def done(self) -> bool:
        """Always True: in a stream, the result is the item after the last token."""
        return True

    def to_dict(self) -> dict:
        """Plain types only (crosses process boundaries); ``done`` marks a stream's end."""
        return {
            "done": True,
            "request_id": self.request_id,
            "token_ids": list(self.token_ids),
            "logprobs": None if self.logprobs is None else list(self.logprobs),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "num_preemptions": self.num_preemptions,
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
        }


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token, as streamed. The last event of a request carries
    ``result`` (its :class:`GenerationResult`); earlier ones carry ``None``."""

    request_id: str
    token_id: int
    logprob: float | None
    index: int  # position in the output, from 0
    result: GenerationResult | None = None
    replica_id: str = ""

    @property
    def is_last(self) -> bool:
        return self.result is not None

    def to_dict(self) -> dict:
        """The token only (a stream's final item, the result, has its own ``to_dict``)."""
        return {"request_id": self.request_id, "token_id": self.token_id, "logprob": self.logprob, "index": self.index}


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; retry later (the app answers 429/503)."""


ItemErrorKind = Literal["invalid", "overloaded", "internal"]


@dataclass(frozen=True, slots=True)
class ItemError:
    """A batch item that failed on the replica while the rest of its batch
    ran: ``invalid`` (the engine rejected the request: ``ValueError``),
    ``overloaded`` (the engine's queue was full) or ``internal``."""

    message: str
    kind: ItemErrorKind

    @classmethod
    def from_exception(cls, error: BaseException) -> ItemError:
        if isinstance(error, EngineOverloaded):
            return cls(str(error), "overloaded")
        return cls(str(error), "invalid" if isinstance(error, ValueError) else "internal")


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One Worker replica's figures as it last posted them to the stats board.

    ``engine``: the engine's ``stats`` snapshot (DESIGN.md's stats contract:
    ``hits``, ``misses``, ``tokens_saved``, ``prefill_tokens``,
    ``cache_num_tokens``, queue and KV figures); ``audit``: the idle-time
    audit (``worker.audit``'s report as a dict) when the replica was idle,
    else ``None``; ``age_s``: seconds since it was posted, set by the reader.
    """

    replica_id: str
    pid: int
    engine: dict
    audit: dict | None = None
    age_s: float = 0.0

    def to_dict(self) -> dict:
        """The flat JSON shape ``GET /stats`` shows per replica."""
        flat = {**self.engine, "replica_id": self.replica_id, "pid": self.pid, "age_s": self.age_s}
        if self.audit is not None:
            flat["audit"] = self.audit
        return flat
