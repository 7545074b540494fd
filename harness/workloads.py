"""The workloads, one module for the simulator (router/workload.py), the load
test, chaos and the benchmarks (worker/bench.py, cache/bench.py). Pure
Python; every draw comes from the caller's seeded ``rng``.

- **Mooncake traces**: :func:`read_mooncake` reads rows ``{timestamp (ms),
  input_length, output_length, hash_ids}``; each hash id names one 512-token
  block, chained (equal ids ⇒ equal prefix). :meth:`TraceRow.chained_keys`
  chains the ids as ``cache.block_hashes`` chains blocks of tokens;
  :class:`TraceBlocks` turns a row into tokens, one fixed random block per id.
- **Shared-prefix groups** (SGLang's generated-shared-prefix):
  :func:`shared_prefix_prompts`, G groups × P prompts, a system prompt of S
  tokens + a question of Q tokens, shuffled.
- **Multi-turn chats**: :func:`multi_turn_chats`, C chats × T turns on one
  system prompt of S tokens; each turn appends the answer and a new question.
- **Hot prefixes** (issue 13): :func:`hot_prefix_prompts`, N requests over G
  shared prefixes of S tokens whose popularity is Zipf-skewed (group of rank
  ``k`` drawn with weight ``1 / k**s``) + a suffix of Q tokens each, so the
  few hottest prefixes overload the replica that holds them.
- **Documents and chats**: :func:`documents_and_chats`, one-off documents
  among questions on a few reused system prompts (what the engine's
  segmented LRU keeps and a plain LRU loses).

The load test's sessions (:class:`Session`, :func:`build_workload`) are built
from these at the end of the module.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from cache import chain_block_keys

MOONCAKE_BLOCK_TOKENS = 512
# Printable-ASCII ids: valid for the byte-level tiny-llama and clear of its specials.
PRINTABLE_TOKENS = (32, 127)


def random_tokens(rng: random.Random, n: int, tokens: tuple[int, int] = PRINTABLE_TOKENS) -> tuple[int, ...]:
    """``n`` token ids drawn uniformly from ``[tokens[0], tokens[1])``."""
    low, high = tokens
    return tuple(rng.randrange(low, high) for _ in range(n))


# ------------------------------------------------------------------ Mooncake
@dataclass(frozen=True, slots=True)
class TraceRow:
    """One Mooncake request. ``num_output_tokens`` is the trace's (may be 0)."""

    arrival_s: float
    hash_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def last_block_tokens(self) -> int:
        """Tokens in the last block (the others hold 512 each)."""
        return self.num_prompt_tokens - MOONCAKE_BLOCK_TOKENS * (len(self.hash_ids) - 1)

    def chained_keys(self) -> tuple[int, ...]:
        """One chained key per FULL block, as ``cache.block_hashes`` gives per block of tokens."""
        is_last_full = self.num_prompt_tokens == MOONCAKE_BLOCK_TOKENS * len(self.hash_ids)
        num_full = len(self.hash_ids) if is_last_full else len(self.hash_ids) - 1
        return tuple(chain_block_keys(self.hash_ids[:num_full]))


def read_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """The first ``limit`` rows (all when None) in file order; ValueError naming the line of a bad row."""
    rows = []
    with open(path) as handle:
        for line_number, line in enumerate(handle, 1):
            if limit is not None and len(rows) >= limit:
                break
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
            rows.append(TraceRow(arrival_s, ids, num_prompt, num_output))
    return rows


class TraceBlocks:
    """Hash id → one fixed random block of ``tokens_per_block`` tokens (scaled
    down from 512), drawn from ``rng`` the first time the id is seen, so equal
    ids give equal prefixes."""

    def __init__(self, rng: random.Random, tokens_per_block: int, tokens: tuple[int, int] = PRINTABLE_TOKENS) -> None:
        self._rng = rng
        self._tokens_per_block = tokens_per_block
        self._token_range = tokens
        self._id_to_block: dict[int, tuple[int, ...]] = {}

    def prompt(self, row: TraceRow) -> tuple[int, ...]:
        """The row's prompt; its last block is cut in proportion (at least one token)."""
        prompt: list[int] = []
        for index, hash_id in enumerate(row.hash_ids):
            if hash_id not in self._id_to_block:
                self._id_to_block[hash_id] = random_tokens(self._rng, self._tokens_per_block, self._token_range)
            block = self._id_to_block[hash_id]
            if index == len(row.hash_ids) - 1:  # the last block is partial in the trace
                block = block[: max(1, round(self._tokens_per_block * row.last_block_tokens / MOONCAKE_BLOCK_TOKENS))]
            prompt.extend(block)
        return tuple(prompt)


# ---------------------------------------------------- shared prefix, chats
@dataclass(frozen=True, slots=True)
class PrefixedPrompt:
    system: tuple[int, ...]
    question: tuple[int, ...]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.system + self.question


def shared_prefix_prompts(rng: random.Random, num_groups: int, prompts_per_group: int, system_tokens: int,
                          question_tokens: int, tokens: tuple[int, int] = PRINTABLE_TOKENS) -> list[PrefixedPrompt]:
    """G groups × P prompts (a group's system prompt, then each prompt's question), shuffled."""
    prompts = []
    for _ in range(num_groups):
        system = random_tokens(rng, system_tokens, tokens)
        prompts.extend(PrefixedPrompt(system, random_tokens(rng, question_tokens, tokens)) for _ in range(prompts_per_group))
    rng.shuffle(prompts)
    return prompts


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """``arrival_s``: 0.0 unless arrivals were drawn; ``answer``: empty unless
    answers were drawn (a live server writes its own)."""

    arrival_s: float
    question: tuple[int, ...]
    answer: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Chat:
    system: tuple[int, ...]
    turns: tuple[ChatTurn, ...]


def multi_turn_chats(rng: random.Random, num_chats: int, num_turns: int, system_tokens: int, question_tokens: int, *,
                     answer_tokens: int = 0, rate_per_s: float | None = None, think_s: float | None = None,
                     tokens: tuple[int, int] = PRINTABLE_TOKENS) -> list[Chat]:
    """Chats on one shared system prompt. With ``rate_per_s``, chats start as
    a Poisson process; with ``think_s``, a turn follows the previous one after
    ``think_s × U(0.5, 1.5)`` seconds."""
    system = random_tokens(rng, system_tokens, tokens)
    chats, start = [], 0.0
    for _ in range(num_chats):
        if rate_per_s is not None:
            start += rng.expovariate(rate_per_s)
        now, turns = start, []
        for _ in range(num_turns):
            question = random_tokens(rng, question_tokens, tokens)
            turns.append(ChatTurn(now, question, random_tokens(rng, answer_tokens, tokens)))
            if think_s is not None:
                now += think_s * (0.5 + rng.random())
        chats.append(Chat(system, tuple(turns)))
    return chats


def zipf_weights(num_groups: int, exponent: float) -> list[float]:
    """Popularity of ranks ``1..num_groups``: ``k ** -exponent``, normalised to sum 1."""
    if type(num_groups) is not int or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if not isinstance(exponent, (int, float)) or exponent < 0:
        raise ValueError(f"zipf exponent must be a number >= 0, got {exponent!r}")
    raw = [k ** -float(exponent) for k in range(1, num_groups + 1)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True, slots=True)
class HotPrefixPrompt:
    """One request of the hot-prefix workload: ``group`` is its prefix's
    popularity rank (0 = hottest); prompts of one group share ``prefix``
    token for token."""

    group: int
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prefix + self.suffix


def hot_prefix_prompts(rng: random.Random, num_groups: int, num_requests: int, prefix_tokens: int, suffix_tokens: int,
                       zipf_exponent: float, tokens: tuple[int, int] = PRINTABLE_TOKENS) -> list[HotPrefixPrompt]:
    """``num_requests`` prompts in arrival order, each drawing its group
    independently from :func:`zipf_weights` (exponent 0: uniform); every
    group's prefix is drawn once, every suffix afresh. Deterministic in ``rng``."""
    for name, value, minimum in (("num_requests", num_requests, 0), ("prefix_tokens", prefix_tokens, 1),
                                 ("suffix_tokens", suffix_tokens, 1)):
        if type(value) is not int or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    weights = zipf_weights(num_groups, zipf_exponent)
    prefixes = [random_tokens(rng, prefix_tokens, tokens) for _ in range(num_groups)]
    groups = rng.choices(range(num_groups), weights=weights, k=num_requests)
    return [HotPrefixPrompt(g, prefixes[g], random_tokens(rng, suffix_tokens, tokens)) for g in groups]


def rotating_hot_prefix_prompts(rng: random.Random, num_phases: int, requests_per_phase: int, hot_share: float,
                                num_background_groups: int, prefix_tokens: int, suffix_tokens: int,
                                tokens: tuple[int, int] = PRINTABLE_TOKENS) -> list[HotPrefixPrompt]:
    """A hot prefix that moves: ``num_phases`` phases of ``requests_per_phase``
    requests in arrival order; in phase ``p`` each request is, with
    probability ``hot_share``, of that phase's own new group (group
    ``num_background_groups + p``), else of one of ``num_background_groups``
    groups drawn uniformly (the steady rest of the traffic). A phase's hot
    group is cold when it starts, is homed on one replica and then takes most
    of the traffic: with 2 replicas its home goes over the load bound and the
    router spills it, so every phase gives fetch work (a stationary Zipf
    spills a hot prefix once, then both replicas hold it). Deterministic in ``rng``."""
    for name, value, minimum in (("num_phases", num_phases, 1), ("requests_per_phase", requests_per_phase, 1),
                                 ("num_background_groups", num_background_groups, 0),
                                 ("prefix_tokens", prefix_tokens, 1), ("suffix_tokens", suffix_tokens, 1)):
        if type(value) is not int or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if not isinstance(hot_share, (int, float)) or not 0 <= hot_share <= 1:
        raise ValueError(f"hot_share must be a number in [0, 1], got {hot_share!r}")
    if num_background_groups == 0 and hot_share < 1:
        raise ValueError("hot_share below 1 needs background groups")
    prefixes = [random_tokens(rng, prefix_tokens, tokens) for _ in range(num_background_groups + num_phases)]
    prompts = []
    for phase in range(num_phases):
        for _ in range(requests_per_phase):
            hot = rng.random() < hot_share
            group = num_background_groups + phase if hot else rng.randrange(num_background_groups)
            prompts.append(HotPrefixPrompt(group, prefixes[group], random_tokens(rng, suffix_tokens, tokens)))
    return prompts


# ------------------------------------------------- the load test's sessions
@dataclass(frozen=True, slots=True)
class Turn:
    question: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation for the load test: a fixed prefix, then turns; turn
    ``k``'s prompt is the prefix + every earlier question and *actual* answer
    + question ``k``. Single-shot workloads are sessions of one turn."""

    prefix: tuple[int, ...]
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0
    salt: str | None = None


def shared_prefix(rng: random.Random, num_groups: int, prompts_per_group: int, system_tokens: int,
                  question_tokens: int, output_tokens: int) -> list[Session]:
    prompts = shared_prefix_prompts(rng, num_groups, prompts_per_group, system_tokens, question_tokens)
    return [Session(p.system, (Turn(p.question, output_tokens),)) for p in prompts]


def multi_turn(rng: random.Random, num_chats: int, num_turns: int, system_tokens: int,
               question_tokens: int, output_tokens: int) -> list[Session]:
    chats = multi_turn_chats(rng, num_chats, num_turns, system_tokens, question_tokens)
    return [Session(c.system, tuple(Turn(t.question, output_tokens) for t in c.turns)) for c in chats]


def hot_prefix(rng: random.Random, num_groups: int, num_requests: int, prefix_tokens: int, suffix_tokens: int,
               zipf_exponent: float, output_tokens: int) -> list[Session]:
    prompts = hot_prefix_prompts(rng, num_groups, num_requests, prefix_tokens, suffix_tokens, zipf_exponent)
    return [Session(p.prefix, (Turn(p.suffix, output_tokens),)) for p in prompts]


def rotating_hot_prefix(rng: random.Random, num_phases: int, requests_per_phase: int, hot_share: float,
                        num_background_groups: int, prefix_tokens: int, suffix_tokens: int,
                        output_tokens: int) -> list[Session]:
    prompts = rotating_hot_prefix_prompts(rng, num_phases, requests_per_phase, hot_share, num_background_groups,
                                          prefix_tokens, suffix_tokens)
    return [Session(p.prefix, (Turn(p.suffix, output_tokens),)) for p in prompts]


def documents_and_chats(rng: random.Random, num_requests: int, num_systems: int, system_tokens: int,
                        question_tokens: int, document_tokens: int, document_share: float,
                        output_tokens: int, tokens: tuple[int, int] = PRINTABLE_TOKENS) -> list[Session]:
    """One-off documents among questions on a few reused system prompts,
    where a cache's eviction order decides what survives: each request is,
    with probability ``document_share``, a fresh document of
    ``document_tokens`` (never seen again), else one of ``num_systems``
    system prompts of ``system_tokens`` + a fresh question. The load test's
    workload and ``harness.eviction_bench``'s stream (``tokens`` 3..258)."""
    if not 0.0 <= document_share <= 1.0:
        raise ValueError(f"document_share must be in [0, 1], got {document_share!r}")
    systems = [random_tokens(rng, system_tokens, tokens) for _ in range(num_systems)]
    sessions = []
    for _ in range(num_requests):
        if rng.random() < document_share:
            sessions.append(Session(random_tokens(rng, document_tokens, tokens), (Turn((), output_tokens),)))
        else:
            system = rng.choice(systems)
            sessions.append(Session(system, (Turn(random_tokens(rng, question_tokens, tokens), output_tokens),)))
    return sessions


def mooncake(rng: random.Random, trace_path: str, tokens_per_block: int, max_requests: int,
             max_prompt_tokens: int, max_output_tokens: int) -> list[Session]:
    """Trace rows → one-turn sessions; prompts truncated to ``max_prompt_tokens``."""
    blocks = TraceBlocks(rng, tokens_per_block)
    sessions = []
    for row in read_mooncake(trace_path, limit=max_requests):
        output = max(1, min(row.num_output_tokens, max_output_tokens))
        sessions.append(Session(blocks.prompt(row)[:max_prompt_tokens], (Turn((), output),), arrival_s=row.arrival_s))
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
    "hot-prefix": {
        "cpu": dict(num_groups=4, num_requests=48, prefix_tokens=1024, suffix_tokens=32, zipf_exponent=1.2,
                    output_tokens=8),
        "gpu": dict(num_groups=32, num_requests=2048, prefix_tokens=4096, suffix_tokens=128, zipf_exponent=1.1,
                    output_tokens=128),
    },
    "rotating-hot-prefix": {
        "cpu": dict(num_phases=8, requests_per_phase=8, hot_share=0.75, num_background_groups=2, prefix_tokens=1024,
                    suffix_tokens=64, output_tokens=8),
        "gpu": dict(num_phases=32, requests_per_phase=64, hot_share=0.75, num_background_groups=8,
                    prefix_tokens=4096, suffix_tokens=128, output_tokens=128),
    },
    "documents-and-chats": {
        "cpu": dict(num_requests=96, num_systems=4, system_tokens=512, question_tokens=32, document_tokens=1024,
                    document_share=0.5, output_tokens=4),
        "gpu": dict(num_requests=1024, num_systems=8, system_tokens=2048, question_tokens=128, document_tokens=8192,
                    document_share=0.5, output_tokens=64),
    },
    "mooncake": {
        "cpu": dict(tokens_per_block=8, max_requests=200, max_prompt_tokens=1024, max_output_tokens=16),
        "gpu": dict(tokens_per_block=128, max_requests=2000, max_prompt_tokens=16384, max_output_tokens=256),
    },
}
WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "hot-prefix": hot_prefix,
             "rotating-hot-prefix": rotating_hot_prefix, "documents-and-chats": documents_and_chats,
             "mooncake": mooncake}


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
