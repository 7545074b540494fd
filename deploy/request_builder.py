"""From a validated HTTP body to a :class:`~worker.messages.WorkerRequest`:
the ingress's limits and the model's bounds checked once, sampling
parameters built, routing block hashes computed.

This is the ingress's one validation of a prompt; the engine checks it once
more on its side of the boundary (``Engine.validate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache import block_hashes
from deploy.errors import APIError
from deploy.request_ids import new_request_id
from deploy.settings import Limits
from worker import SamplingParams
from worker.messages import WorkerRequest


@dataclass(frozen=True, slots=True)
class ModelBounds:
    """What the served model allows (read from it once, at start-up)."""

    vocab_size: int
    max_model_len: int

    @classmethod
    def from_info(cls, model_info: dict) -> ModelBounds:
        return cls(model_info["vocab_size"], model_info["max_model_len"])


class RequestBuilder:
    def __init__(self, limits: Limits, bounds: ModelBounds, router_block_size: int) -> None:
        self.limits = limits
        self.bounds = bounds
        self.router_block_size = router_block_size

    def check_prompt(self, token_ids: Sequence[int], max_new_tokens: int, param: str = "prompt") -> tuple[int, ...]:
        limits, vocab_size = self.limits, self.bounds.vocab_size
        if not token_ids:
            raise APIError(400, f"{param} is empty", param=param)
        if len(token_ids) > limits.max_prompt_tokens:
            raise APIError(
                400, f"{param} has {len(token_ids)} tokens, over the limit of {limits.max_prompt_tokens}", param=param
            )
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in {param} is outside the vocabulary [0, {vocab_size})", param=param)
        if max_new_tokens > limits.max_new_tokens:
            raise APIError(
                400, f"max new tokens {max_new_tokens} is over the limit of {limits.max_new_tokens}", param="max_tokens"
            )
        if len(token_ids) + max_new_tokens > self.bounds.max_model_len:
            raise APIError(
                400,
                f"{param} ({len(token_ids)} tokens) + {max_new_tokens} new tokens exceeds the model's context"
                f" length of {self.bounds.max_model_len}",
                param=param,
            )
        return tuple(token_ids)

    def check_stop_token_ids(self, stop_token_ids: Sequence[int] | None) -> tuple[int, ...]:
        stop = tuple(stop_token_ids or ())
        bad = next((t for t in stop if not 0 <= t < self.bounds.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop token id {bad} is outside the vocabulary", param="stop_token_ids")
        return stop

    def sampling(self, **fields) -> SamplingParams:
        """``SamplingParams`` of the fields given (``None`` = the default); 400 when invalid."""
        try:
            return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
        except ValueError as error:
            raise APIError(400, str(error)) from None

    def request(self, token_ids: tuple[int, ...], params: SamplingParams, salt: str | None) -> WorkerRequest:
        """A worker request for a prompt :meth:`check_prompt` passed."""
        return WorkerRequest(
            request_id=new_request_id(),  # unique across ingress replicas and nodes
            prompt_token_ids=token_ids,
            params=params,
            salt=salt,
            block_hashes=tuple(block_hashes(token_ids, self.router_block_size, salt)),
        )
