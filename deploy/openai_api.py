"""The OpenAI-compatible routes' logic: ``/v1/completions`` and
``/v1/chat/completions``, whole or streamed as server-sent events.

Each (prompt, choice) pair is one worker request. Choices run concurrently;
prompts that share a prefix land on the same replica through the router, so
``n > 1`` computes the prompt once. Stop strings are matched on the decoded
text and end the worker request as soon as they appear.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deploy.auth import compose_salt
from deploy.dispatch import Dispatcher
from deploy.errors import APIError
from deploy.protocol import ChatCompletionRequest, CompletionRequest
from deploy.request_builder import RequestBuilder
from deploy.textstream import TextStream
from worker.messages import WorkerRequest
from worker.results import GenerationResult


@dataclass(slots=True)
class ChoiceState:
    """One choice's progress: what was generated and how it ended."""

    index: int
    prompt_tokens: int
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None


class OpenAIRoutes:
    """``model_name``: the id clients must send; ``builder`` checks and builds
    each (prompt, choice) request; ``dispatcher`` runs them."""

    def __init__(self, model_name: str, tokenizer, builder: RequestBuilder, dispatcher: Dispatcher) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.builder = builder
        self.dispatcher = dispatcher
        self.limits = builder.limits

    # ----------------------------------------------------------- preparation
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found", param="model",
            )

    def _check_unsupported(self, body) -> None:
        for name in body.unsupported_fields():
            if (body.model_extra or {}).get(name) is not None:
                raise APIError(400, f"parameter {name!r} is not supported", param=name)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from None
        if getattr(self.tokenizer, "chat_template", None):
            token_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(token_ids, dict) or hasattr(token_ids, "keys"):
                token_ids = token_ids["input_ids"]
            return list(token_ids)
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return self._encode(text)

    def _requests(self, prompts: list[list[int]], body, max_tokens: int,
                  namespace: str | None = None) -> list[tuple[WorkerRequest, ChoiceState]]:
        """One (worker request, state) per prompt × choice; ``namespace``: the
        API key's cache namespace, composed with the client's ``cache_salt``."""
        builder = self.builder
        if body.n > self.limits.max_n:
            raise APIError(400, f"n={body.n} is over the limit of {self.limits.max_n}", param="n")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop strings are allowed", param="stop")
        salt = compose_salt(namespace, body.cache_salt)
        pairs = []
        for prompt_index, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{prompt_index}]"
            token_ids = builder.check_prompt(prompt, max_tokens, param=param if isinstance(body, CompletionRequest) else "messages")
            for choice in range(body.n):
                params = builder.sampling(
                    max_new_tokens=max_tokens,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=max(body.top_k, 0),
                    seed=None if body.seed is None else body.seed + choice,
                    logprobs=True,
                    ignore_eos=body.ignore_eos,
                )
                state = ChoiceState(len(pairs), len(token_ids), TextStream(self.tokenizer.decode, stop))
                pairs.append((builder.request(token_ids, params, salt), state))
        return pairs

    def completion_requests(self, body: CompletionRequest, salt_header: str | None, namespace: str | None = None):
        self._check_model(body.model)
        self._check_unsupported(body)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [self._encode(p) for p in prompt]
        elif all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if len(prompts) * body.n > self.limits.max_batch_prompts:
            raise APIError(400, "too many prompts × choices in one request", param="prompt")
        body = body.model_copy(update={"cache_salt": body.cache_salt or salt_header})
        return self._requests(prompts, body, body.max_tokens or 16, namespace)

    def chat_requests(self, body: ChatCompletionRequest, salt_header: str | None, namespace: str | None = None):
        self._check_model(body.model)
        self._check_unsupported(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = self.limits.max_new_tokens
        prompt = self._chat_prompt(body)
        max_tokens = min(max_tokens, max(1, self.builder.bounds.max_model_len - len(prompt)))
        body = body.model_copy(update={"cache_salt": body.cache_salt or salt_header})
        return self._requests([prompt], body, max_tokens, namespace)

    # -------------------------------------------------------------- running
    async def _run_choice(self, request: WorkerRequest, state: ChoiceState, incremental: bool) -> AsyncIterator[Delta]:
        """Deltas of one choice, one per list of tokens the worker sent
        together (so one SSE event per list, as vLLM's ``--stream-interval``
        merges its deltas); the last one has ``finish_reason``."""
        if not incremental and not state.text._stop:
            result = await self.dispatcher.run(request)
            for token_id in result.token_ids:
                state.text.push(token_id)
            state.token_ids, state.logprobs = list(result.token_ids), list(result.logprobs or [])
            state.cached_tokens = result.cached_tokens
            state.text.finish()
            state.finish_reason = result.finish_reason
            yield Delta(state.index, state.text.text, tuple(state.token_ids), tuple(state.logprobs), state.finish_reason)
            return
        lists = self.dispatcher.stream_lists(request)
        try:
            token_ids, logprobs, detokenizer = state.token_ids, state.logprobs, state.text
            async for items in lists:
                first, text = len(token_ids), ""
                for item in items:
                    if isinstance(item, GenerationResult):
                        state.cached_tokens = item.cached_tokens
                        text += detokenizer.finish()
                        state.finish_reason = "stop" if detokenizer.stopped else item.finish_reason
                        break
                    token_ids.append(item.token_id)
                    logprobs.append(item.logprob)
                    text += detokenizer.push(item.token_id)
                    if detokenizer.stopped:
                        state.finish_reason = "stop"
                        break
                new_ids, new_logprobs = tuple(token_ids[first:]), tuple(logprobs[first:])
                if state.finish_reason is not None:
                    yield Delta(state.index, text, new_ids, new_logprobs, state.finish_reason)
                    return
                if text or not incremental:
                    yield Delta(state.index, text, new_ids, new_logprobs)
        finally:
            await lists.aclose()

    async def _merged(self, pairs, incremental: bool) -> AsyncIterator[Delta]:
        """Every choice's deltas as they come (choices run concurrently)."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(request, state):
            try:
                async for delta in self._run_choice(request, state, incremental):
                    await queue.put(delta)
            except BaseException as error:  # noqa: BLE001 - forwarded to the consumer
                await queue.put(error)
            finally:
                await queue.put(done)

        tasks = [asyncio.ensure_future(pump(r, s)) for r, s in pairs]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, pairs, incremental: bool = False) -> list[ChoiceState]:
        async for _ in self._merged(pairs, incremental):
            pass
        return [state for _, state in pairs]

    # ------------------------------------------------------------ responses
    def usage(self, states: list[ChoiceState], pairs) -> dict:
        """Token counts, each prompt counted once however many choices it has:
        its cached tokens are the fewest any of its choices found cached (what
        the cache held for it before this request), so ``cached_tokens`` never
        exceeds ``prompt_tokens``."""
        prompt_to_tokens: dict[int, int] = {}
        prompt_to_cached: dict[int, int] = {}
        for request, state in pairs:
            key = id(request.prompt_token_ids)  # the choices of one prompt share its tuple
            prompt_to_tokens[key] = request.num_prompt_tokens
            prompt_to_cached[key] = min(prompt_to_cached.get(key, state.cached_tokens), state.cached_tokens)
        prompt_tokens = sum(prompt_to_tokens.values())
        completion_tokens = sum(len(s.token_ids) for s in states)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(prompt_to_cached.values())},
        }

    def completion_body(self, states, pairs, created: int, completion_id: str, with_logprobs: bool) -> dict:
        choices = []
        for state in states:
            logprobs = None
            if with_logprobs:
                logprobs = {
                    "tokens": [self.tokenizer.decode([t]) for t in state.token_ids],
                    "token_logprobs": state.logprobs,
                    "top_logprobs": None,
                    "text_offset": None,
                }
            choices.append({"index": state.index, "text": state.text.text, "logprobs": logprobs, "finish_reason": state.finish_reason})
        return {
            "id": completion_id, "object": "text_completion", "created": created,
            "model": self.model_name, "choices": choices, "usage": self.usage(states, pairs),
        }

    def chat_body(self, states, pairs, created: int, completion_id: str, with_logprobs: bool) -> dict:
        choices = []
        for state in states:
            logprobs = None
            if with_logprobs:
                logprobs = {"content": [
                    {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(state.token_ids, state.logprobs)
                ]}
            choices.append({
                "index": state.index, "message": {"role": "assistant", "content": state.text.text},
                "logprobs": logprobs, "finish_reason": state.finish_reason,
            })
        return {
            "id": completion_id, "object": "chat.completion", "created": created,
            "model": self.model_name, "choices": choices, "usage": self.usage(states, pairs),
        }

    def deltas(self, pairs) -> AsyncIterator[Delta]:
        """Every choice's deltas as they are produced (what :meth:`sse` formats)."""
        return self._merged(pairs, incremental=True)

    async def sse(self, pairs, deltas: AsyncIterator[Delta], chat: bool, include_usage: bool,
                  with_logprobs: bool) -> AsyncIterator[str]:
        """Server-sent events for a streamed completion of ``deltas``
        (from :meth:`deltas`), ending with ``[DONE]``."""
        created, completion_id = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        base = {"id": completion_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}
        try:
            if chat:
                for _, state in pairs:
                    yield _event({**base, "choices": [
                        {"index": state.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    ]})
            async for delta in deltas:
                if chat:
                    choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                              "logprobs": None, "finish_reason": delta.finish_reason}
                    if with_logprobs and delta.token_ids:
                        choice["logprobs"] = {"content": [
                            {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                            for t, lp in zip(delta.token_ids, delta.logprobs)
                        ]}
                else:
                    choice = {"index": delta.index, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
                    if with_logprobs and delta.token_ids:
                        choice["logprobs"] = {"tokens": [self.tokenizer.decode([t]) for t in delta.token_ids],
                                              "token_logprobs": list(delta.logprobs), "top_logprobs": None, "text_offset": None}
                yield _event({**base, "choices": [choice]})
            if include_usage:
                yield _event({**base, "choices": [], "usage": self.usage([s for _, s in pairs], pairs)})
        except APIError as error:
            yield error.sse_event()
        yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
