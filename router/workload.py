"""The simulator's requests for the workloads of ``harness/workloads.py``
(which generates them): a Mooncake trace, shared-prefix groups, multi-turn
chats; and the load test's own sessions (:func:`from_sessions`), for the
simulator's closed-loop replay of a live run."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from itertools import chain, islice, repeat
from pathlib import Path

from cache import block_hashes
from harness.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    multi_turn_chats,
    random_tokens,
    read_mooncake,
    shared_prefix_prompts,
)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request as the simulator replays it.

    ``units``: what a replica's radix tree caches for the prompt. Token ids
    (``unit_tokens == 1``) for generated workloads; for a Mooncake trace one
    unit per 512-token hash-id block, so a 15k-token prompt is ~30 units and
    a replay stays fast (the last unit may be partial: it holds the remaining
    ``num_prompt_tokens - unit_tokens * (len(units) - 1)`` tokens).
    ``cache_units``: what the replica caches once the request finishes
    (prompt plus answer in a chat, so the next turn hits).
    ``block_hashes``: the router's chained hashes (its block size is
    ``unit_tokens * units_per_block``); the router never sees ``units``.
    """

    arrival_s: float
    units: tuple[int, ...]
    unit_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: tuple[int, ...]
    cache_units: tuple[int, ...]

    def token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids, as the ingress has them live.

        Generated workloads carry them (``unit_tokens == 1``). A trace names
        each 512-token block by a hash id and says nothing more of its
        content, so a unit stands in as its hash id repeated once per token,
        cut at the prompt's length. Two prompts then share a unit's tokens
        exactly when they share its hash id. A partial last unit shares only
        with the same partial unit, since a trace gives one hash id one
        length. With them the router matches within a block as it does live,
        and sees nothing the trace does not say."""
        if self.unit_tokens == 1:
            return self.units
        stand_in = chain.from_iterable(repeat(unit, self.unit_tokens) for unit in self.units)
        return tuple(islice(stand_in, self.num_prompt_tokens))

    def cached_tokens(self, num_units: int) -> int:
        """Prompt tokens a match of ``num_units`` leading units reuses (at most T - 1)."""
        if num_units >= len(self.units):
            reused = self.num_prompt_tokens
        else:
            reused = num_units * self.unit_tokens
        return max(0, min(reused, self.num_prompt_tokens - 1))


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[SimRequest, ...]
    unit_tokens: int
    router_block_tokens: int  # tokens per router block; a multiple of unit_tokens
    name: str
    # Request numbers of each client session, turns in order (the closed loop
    # sends a session's next turn when the last completes); () = one each.
    sessions: tuple[tuple[int, ...], ...] = ()

    @property
    def units_per_block(self) -> int:
        return self.router_block_tokens // self.unit_tokens


def load_mooncake(path: str | Path, limit: int | None = None) -> Workload:
    """A Mooncake trace (``harness.workloads.read_mooncake``) as simulator
    requests, one unit per 512-token hash-id block, by arrival time."""
    requests = [
        SimRequest(
            arrival_s=row.arrival_s,
            units=row.hash_ids,
            unit_tokens=MOONCAKE_BLOCK_TOKENS,
            num_prompt_tokens=row.num_prompt_tokens,
            num_output_tokens=max(row.num_output_tokens, 1),
            block_hashes=row.chained_keys(),
            cache_units=row.hash_ids,
        )
        for row in read_mooncake(path, limit)
    ]
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(tuple(requests), MOONCAKE_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS, "mooncake")


_SIM_TOKENS = (1, 32000)


def _token_request(arrival_s: float, prompt: list[int], answer: list[int], block_tokens: int) -> SimRequest:
    return SimRequest(
        arrival_s=arrival_s,
        units=tuple(prompt),
        unit_tokens=1,
        num_prompt_tokens=len(prompt),
        num_output_tokens=len(answer),
        block_hashes=tuple(block_hashes(prompt, block_tokens)),
        cache_units=tuple(prompt + answer),
    )


def shared_prefix(
    num_groups: int = 16, prompts_per_group: int = 16, system_tokens: int = 1024, question_tokens: int = 64,
    output_tokens: int = 64, block_tokens: int = 64, rate_per_s: float = 10.0, seed: int = 0,
) -> Workload:
    """``harness.workloads.shared_prefix_prompts`` with Poisson arrivals and
    random answers (SGLang's generated-shared-prefix bench, scaled down)."""
    rng = random.Random(seed)
    prompts = shared_prefix_prompts(rng, num_groups, prompts_per_group, system_tokens, question_tokens, _SIM_TOKENS)
    now, requests = 0.0, []
    for prompt in prompts:
        now += rng.expovariate(rate_per_s)
        answer = list(random_tokens(rng, output_tokens, _SIM_TOKENS))
        requests.append(_token_request(now, list(prompt.token_ids), answer, block_tokens))
    return Workload(tuple(requests), 1, block_tokens, "shared-prefix")


def multi_turn(
    num_conversations: int = 64, num_turns: int = 6, system_tokens: int = 512, question_tokens: int = 128,
    output_tokens: int = 128, block_tokens: int = 64, rate_per_s: float = 4.0, think_s: float = 5.0, seed: int = 0,
) -> Workload:
    """``harness.workloads.multi_turn_chats`` (every request shares the system
    prompt's blocks); each turn's prompt is the history plus its question.
    Requests in arrival order; ``Workload.sessions`` lists each chat's
    request numbers in turn order (chats by their first turn's arrival), so
    closed-loop arrivals send a turn only once the chat's previous turn has
    its answer, as a client would."""
    chats = multi_turn_chats(random.Random(seed), num_conversations, num_turns, system_tokens, question_tokens,
                             answer_tokens=output_tokens, rate_per_s=rate_per_s, think_s=think_s, tokens=_SIM_TOKENS)
    turns = []  # (request, chat number)
    for chat_number, chat in enumerate(chats):
        history = list(chat.system)
        for turn in chat.turns:
            prompt = history + list(turn.question)
            turns.append((_token_request(turn.arrival_s, prompt, list(turn.answer), block_tokens), chat_number))
            history = prompt + list(turn.answer)
    turns.sort(key=lambda item: item[0].arrival_s)  # stable: a chat's turns keep their order on equal times
    numbers: dict[int, list[int]] = {}
    for number, (_, chat_number) in enumerate(turns):
        numbers.setdefault(chat_number, []).append(number)
    sessions = tuple(sorted((tuple(chat_numbers) for chat_numbers in numbers.values()), key=lambda s: s[0]))
    return Workload(tuple(request for request, _ in turns), 1, block_tokens, "multi-turn", sessions)


def scale_arrivals(workload: Workload, factor: float) -> Workload:
    """Arrival times multiplied by ``factor`` (relative to the first arrival)."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"arrival scale factor must be a positive number, got {factor!r}")
    if not workload.requests:
        return workload
    t0 = workload.requests[0].arrival_s
    scaled = tuple(
        SimRequest(t0 + (r.arrival_s - t0) * factor, r.units, r.unit_tokens, r.num_prompt_tokens,
                   r.num_output_tokens, r.block_hashes, r.cache_units)
        for r in workload.requests
    )
    return Workload(scaled, workload.unit_tokens, workload.router_block_tokens, workload.name, workload.sessions)


def from_sessions(sessions, block_tokens: int, name: str, seed: int = 0) -> Workload:
    """The load test's ``harness.workloads.Session`` list as simulator
    requests, session by session: turn ``k``'s prompt is the prefix, every
    earlier question and answer, and question ``k``, as the load test builds
    it; an answer is ``max_new_tokens`` random tokens, cached but its last
    (which has no KV in the engine) (the load test sends
    ``ignore_eos``, so the live answer has that length too; its tokens differ,
    which changes no match: each chat's history is its own).
    ``Workload.sessions`` keeps each session's request numbers."""
    rng = random.Random(seed)
    requests, numbers = [], []
    for session in sessions:
        history, turns = list(session.prefix), []
        for turn in session.turns:
            prompt = history + list(turn.question)
            answer = list(random_tokens(rng, turn.max_new_tokens, _SIM_TOKENS))
            turns.append(len(requests))
            # the engine caches every token with KV: prompt + answer but its last token
            requests.append(_token_request(0.0, prompt, answer[:-1], block_tokens))
            requests[-1] = replace(requests[-1], num_output_tokens=len(answer))
            history = prompt + answer
        numbers.append(tuple(turns))
    return Workload(tuple(requests), 1, block_tokens, name, tuple(numbers))
