"""A request's state inside the engine, from arrival to finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.results import FinishReason, GenerationResult
from worker.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Prompt + generated tokens and where their KV stands.

    Invariants while RUNNING (checked by the scheduler): the KV cache holds
    ``len(token_ids)`` or ``len(token_ids) - 1`` reserved positions for
    ``request_id``; ``num_computed <= len(token_ids)`` positions have KV in
    them, of which the KV cache has cached its first
    ``kv.num_cached_tokens(request_id)`` (and keeps their tree path locked).
    A preempted sequence goes back to WAITING with ``num_computed = 0`` and
    keeps its generated tokens (they are recomputed as prompt).
    """

    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    salt: str | None
    arrival_s: float
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    num_computed: int = 0
    prefill_target: int = 0  # len(token_ids) at admission; prefilling while num_computed < this
    cached_tokens: int | None = None  # reuse at first admission
    num_preemptions: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    first_scheduled_s: float | None = None  # first admitted to a step (engine clock)
    first_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: FinishReason | None = None
    key: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # token_ids as array, refreshed on (re)queue

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    def refresh_key(self) -> None:
        self.key = np.asarray(self.token_ids, dtype=np.int64)

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        return GenerationResult(
            token_ids=tuple(self.token_ids[self.prompt_len :]),
            logprobs=tuple(self.output_logprobs) if self.params.logprobs else None,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached_tokens or 0,
            finish_reason=self.finish_reason,
            ttft_s=None if self.first_token_s is None else self.first_token_s - self.arrival_s,
            request_id=self.request_id,
            num_preemptions=self.num_preemptions,
            queue_s=_between(self.arrival_s, self.first_scheduled_s),
            prefill_s=_between(self.first_scheduled_s, self.first_token_s),
            decode_s=_between(self.first_token_s, self.finished_s),
        )


def _between(start_s: float | None, end_s: float | None) -> float | None:
    """``end_s - start_s``, or None if either is unknown."""
    return None if start_s is None or end_s is None else end_s - start_s
