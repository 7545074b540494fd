"""Request streams for the simulator: a Mooncake trace, shared-prefix groups,
multi-turn chats."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from cache import block_hashes, chain_block_keys

MOONCAKE_BLOCK_TOKENS = 512


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

    @property
    def units_per_block(self) -> int:
        return self.router_block_tokens // self.unit_tokens


def load_mooncake(path: str | Path, limit: int | None = None) -> Workload:
    """Rows ``{timestamp (ms), input_length, output_length, hash_ids}``; each
    hash id names one 512-token block, chained (equal ids ⇒ equal prefix)."""
    requests = []
    with open(path) as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = tuple(int(h) for h in row["hash_ids"])
                num_prompt, num_output = int(row["input_length"]), int(row["output_length"])
                arrival_s = float(row["timestamp"]) / 1000.0
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}:{line_number}: not a Mooncake trace row ({error})") from None
            if not ids or num_prompt <= 0 or num_prompt > MOONCAKE_BLOCK_TOKENS * len(ids):
                raise ValueError(f"{path}:{line_number}: input_length {num_prompt} does not fit {len(ids)} blocks")
            num_full = len(ids) if num_prompt == MOONCAKE_BLOCK_TOKENS * len(ids) else len(ids) - 1
            requests.append(SimRequest(
                arrival_s=arrival_s,
                units=ids,
                unit_tokens=MOONCAKE_BLOCK_TOKENS,
                num_prompt_tokens=num_prompt,
                num_output_tokens=max(num_output, 1),
                block_hashes=tuple(chain_block_keys(ids[:num_full])),
                cache_units=ids,
            ))
            if limit is not None and len(requests) >= limit:
                break
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(tuple(requests), MOONCAKE_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS, "mooncake")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 32000) for _ in range(n)]


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
    """G groups × P prompts: a per-group system prompt + a question, shuffled,
    Poisson arrivals (SGLang's generated-shared-prefix bench, scaled down)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_groups):
        system = _tokens(rng, system_tokens)
        prompts.extend(system + _tokens(rng, question_tokens) for _ in range(prompts_per_group))
    rng.shuffle(prompts)
    now, requests = 0.0, []
    for prompt in prompts:
        now += rng.expovariate(rate_per_s)
        requests.append(_token_request(now, prompt, _tokens(rng, output_tokens), block_tokens))
    return Workload(tuple(requests), 1, block_tokens, "shared-prefix")


def multi_turn(
    num_conversations: int = 64, num_turns: int = 6, system_tokens: int = 512, question_tokens: int = 128,
    output_tokens: int = 128, block_tokens: int = 64, rate_per_s: float = 4.0, think_s: float = 5.0, seed: int = 0,
) -> Workload:
    """Chats that all share one system prompt (every request shares its first
    blocks); each turn appends the answer and a new question."""
    rng = random.Random(seed)
    system = _tokens(rng, system_tokens)
    requests, start = [], 0.0
    for _ in range(num_conversations):
        start += rng.expovariate(rate_per_s)
        history, now = list(system), start
        for _ in range(num_turns):
            prompt = history + _tokens(rng, question_tokens)
            answer = _tokens(rng, output_tokens)
            requests.append(_token_request(now, prompt, answer, block_tokens))
            history = prompt + answer
            now += think_s * (0.5 + rng.random())
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(tuple(requests), 1, block_tokens, "multi-turn")


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
    return Workload(scaled, workload.unit_tokens, workload.router_block_tokens, workload.name)
