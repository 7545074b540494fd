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

    @property
    def is_last(self) -> bool:
        return self.result is not None

    def to_dict(self) -> dict:
        """The token only (a stream's final item, the result, has its own ``to_dict``)."""
        return {"request_id": self.request_id, "token_id": self.token_id, "logprob": self.logprob, "index": self.index}
