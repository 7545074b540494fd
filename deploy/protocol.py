"""HTTP request bodies: the token-level API and the OpenAI-compatible subset.

Pydantic models validate shape and types (strict: no "1" for 1, no floats or
bools for token ids). Limits that depend on the served model (vocabulary,
context length) are checked later, in the ingress, against the live config.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _OpenAIBody(BaseModel):
    # Clients send fields we do not implement (user, metadata, ...): accept and
    # ignore those, but reject the ones that would change the answer (below).
    model_config = ConfigDict(extra="allow")

    @classmethod
    def unsupported_fields(cls) -> tuple[str, ...]:
        return ("best_of", "suffix", "logit_bias", "tools", "tool_choice", "functions", "response_format")


class SamplingFields(BaseModel):
    """Sampling knobs shared by every generate route (greedy by default)."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    seed: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False


class GenerateRequest(_Body, SamplingFields):
    prompt_token_ids: TokenIds
    max_new_tokens: Annotated[StrictInt, Field(ge=1)] = 16
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    logprobs: StrictBool = False
    stream: StrictBool = False


class GenerateBatchRequest(_Body, SamplingFields):
    prompts: Annotated[list[TokenIds], Field(min_length=1)]
    max_new_tokens: Annotated[StrictInt, Field(ge=1)] = 16
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    logprobs: StrictBool = False


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class CompletionRequest(_OpenAIBody):
    model: StrictStr
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: StrictBool = False
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    ignore_eos: StrictBool = False  # vLLM's extra parameter: run to max_tokens (vllm bench serve --ignore-eos)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and any(isinstance(p, str) and not p for p in prompt):
            raise ValueError("prompt strings must not be empty")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are rejected."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_OpenAIBody):
    model: StrictStr
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=0)] | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    ignore_eos: StrictBool = False  # vLLM's extra parameter: run to max_tokens
