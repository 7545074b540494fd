"""Load-test workloads as token sessions (pure; seeded).

A :class:`Session` is a conversation: a fixed prefix, then turns; turn ``k``'s
prompt is the prefix + every earlier question and *actual* answer + question
``k``. Single-shot workloads are sessions of one turn.

- ``shared-prefix`` (SGLang's generated-shared-prefix): G groups × P prompts,
  a system prompt of S tokens + a question of Q tokens, shuffled.
- ``multi-turn``: C chats × T turns, each turn appends the answer and a new
  question of Q tokens to a system prompt of S tokens.
- ``mooncake``: a Mooncake-format trace; each ``hash_id`` becomes one fixed
  random block of ``tokens_per_block`` tokens (scaled down from 512), so equal
  ids give equal prefixes; arrival times from the trace.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

# Printable-ASCII ids: valid for the byte-level tiny-llama and clear of its specials.
_TOKEN_LOW, _TOKEN_HIGH = 32, 127


@dataclass(frozen=True, slots=True)
class Turn:
    question: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    prefix: tuple[int, ...]
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0
    salt: str | None = None


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(_TOKEN_LOW, _TOKEN_HIGH) for _ in range(n))


def shared_prefix(rng: random.Random, num_groups: int, prompts_per_group: int, system_tokens: int,
                  question_tokens: int, output_tokens: int) -> list[Session]:
    sessions = []
    for _ in range(num_groups):
        system = _tokens(rng, system_tokens)
        for _ in range(prompts_per_group):
            sessions.append(Session(system, (Turn(_tokens(rng, question_tokens), output_tokens),)))
    rng.shuffle(sessions)
    return sessions


def multi_turn(rng: random.Random, num_chats: int, num_turns: int, system_tokens: int,
               question_tokens: int, output_tokens: int) -> list[Session]:
    system = _tokens(rng, system_tokens)
    return [
        Session(system, tuple(Turn(_tokens(rng, question_tokens), output_tokens) for _ in range(num_turns)))
        for _ in range(num_chats)
    ]


def mooncake(rng: random.Random, trace_path: str, tokens_per_block: int, max_requests: int,
             max_prompt_tokens: int, max_output_tokens: int) -> list[Session]:
    """Trace rows → one-turn sessions; prompts truncated to ``max_prompt_tokens``."""
    id_to_block: dict[int, tuple[int, ...]] = {}
    sessions = []
    with open(trace_path) as file:
        for line in file:
            if len(sessions) >= max_requests:
                break
            row = json.loads(line)
            hash_ids = row["hash_ids"]
            last_block_tokens = row["input_length"] - 512 * (len(hash_ids) - 1)
            prompt: list[int] = []
            for index, hash_id in enumerate(hash_ids):
                if hash_id not in id_to_block:
                    id_to_block[hash_id] = _tokens(rng, tokens_per_block)
                block = id_to_block[hash_id]
                if index == len(hash_ids) - 1:  # the last block is partial in the trace
                    block = block[: max(1, round(tokens_per_block * last_block_tokens / 512))]
                prompt.extend(block)
            prompt = prompt[:max_prompt_tokens]
            output = max(1, min(row["output_length"], max_output_tokens))
            sessions.append(Session(tuple(prompt), (Turn((), output),), arrival_s=row["timestamp"] / 1000.0))
    return sessions


PRESETS = {
    "shared-prefix": {
        "cpu": dict(num_groups=8, prompts_per_group=16, system_tokens=512, question_tokens=32, output_tokens=16),
        "gpu": dict(num_groups=64, prompts_per_group=16, system_tokens=2048, question_tokens=128, output_tokens=256),
    },
    "multi-turn": {
        "cpu": dict(num_chats=24, num_turns=4, system_tokens=256, question_tokens=32, output_tokens=16),
        "gpu": dict(num_chats=128, num_turns=8, system_tokens=1024, question_tokens=128, output_tokens=128),
    },
    "mooncake": {
        "cpu": dict(tokens_per_block=8, max_requests=200, max_prompt_tokens=1024, max_output_tokens=16),
        "gpu": dict(tokens_per_block=128, max_requests=2000, max_prompt_tokens=16384, max_output_tokens=256),
    },
}
WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "mooncake": mooncake}


def build_workload(name: str, scale: str, overrides: dict, trace_path: str | None, seed: int) -> list[Session]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    params = {**PRESETS[name][scale], **overrides}
    rng = random.Random(seed)
    if name == "mooncake":
        if not trace_path:
            raise ValueError("the mooncake workload needs --trace FILE")
        return mooncake(rng, trace_path, **params)
    return WORKLOADS[name](rng, **params)
