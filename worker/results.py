"""What the engine hands back: per-token events and the final result."""

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
    submission to the first generated token.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    prompt_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    ttft_s: float | None
    request_id: str = ""
    num_preemptions: int = 0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token, as streamed. The last event of a request carries
    ``result`` (its :class:`GenerationResult`); earlier ones carry ``None``."""

    request_id: str
    token_id: int
    logprob: float | None
    index: int  # position in the output, from 0
    result: GenerationResult | None = None

    @property
    def is_last(self) -> bool:
        return self.result is not None
