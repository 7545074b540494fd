"""The whole policy through a long random run of what a live router meets.

Decisions (reserved, confirmed, moved to another replica, never confirmed,
asked again), completions, other routers' decisions (shared, or seen only
in the summaries), replicas joining,
leaving and restarting, summaries from each replica's real
``cache.summary_sender.SummarySender`` (snapshots, deltas, bases named by
reference), some lost as Serve's latest-value channel loses them, bases
fetched late, malformed stats, and caches so small that the index trims at
almost every summary. The policy never raises, ranks only live candidates,
and keeps every invariant (``check_invariants`` after each step), under
every pinned config (``test_decision_pins.CONFIGS``).

(The index's own random runs, ``test_prefix_index.py``, drive summaries
harder: they caught a trim taking a re-reported block twice, a
``KeyError`` out of ``on_routing_stats``, which promises never to raise.)
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from cache import block_hashes
from cache.packed_hashes import unpack_block_hashes
from cache.summary import BASE_REF_KEY, CacheSummary
from cache.summary_sender import SummarySender
from router import PolicyConfig, PrefixAffinityPolicy
from router.request import RoutingRequest
from tests.router.fake_clock import Clock
from tests.router.test_decision_pins import CONFIGS

BLOCK = 4
STEPS = 400


class _Worker:
    """One replica process: an LRU cache of blocks (prompts routed here and
    their answers' blocks), counters, and the summary sender a live Worker
    uses; a restart is a new ``_Worker`` (a new epoch, an empty cache)."""

    def __init__(self, replica_id: str, rng: random.Random, bases: dict[int, bytes]) -> None:
        self.replica_id = replica_id
        self.capacity_blocks = rng.choice([3, 8, 24])
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.version = 0
        self.prefill_total = 0
        self.output_total = 0
        self.busy_s = 0.0

        def put(raw: bytes) -> int:
            bases[len(bases)] = raw
            return len(bases) - 1

        self.sender = SummarySender(replica_id, put=put, max_periods=rng.choice([1, 3]), ref_every=rng.choice([1, 4]))

    def serve(self, hashes: tuple[int, ...], answer_blocks: int, rng: random.Random) -> None:
        answer = (hash((hashes[-1:], k)) & (1 << 62) - 1 for k in range(answer_blocks))  # the same answer again
        for block_hash in (*hashes, *answer):
            self.blocks[block_hash] = None
            self.blocks.move_to_end(block_hash)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)
        self.prefill_total += BLOCK * len(hashes)
        self.output_total += BLOCK * answer_blocks
        self.busy_s += 0.01

    def report(self, now: float, rng: random.Random) -> dict:
        self.version += 1
        full = CacheSummary(
            self.replica_id, self.version, now, BLOCK, frozenset(self.blocks),
            num_cached_tokens=BLOCK * len(self.blocks), budget_tokens=BLOCK * self.capacity_blocks,
            num_queued_tokens=rng.randrange(0, 200), num_running_tokens=rng.randrange(0, 200),
            num_running=rng.randrange(0, 3), num_waiting=rng.randrange(0, 3),
            mean_output_tokens=rng.choice([0.0, 17.5, 300.0]), num_prefill_tokens_total=self.prefill_total,
            num_output_tokens_total=self.output_total, busy_s_total=self.busy_s,
            decode_token_cost=rng.choice([0.0, 3.0]), queue_token_cost=rng.choice([0.0, 5.0]),
            fetch_token_cost=rng.choice([0.0, 0.1]), fetch_overhead_tokens=rng.choice([0.0, 64.0]))
        return self.sender.encode(full)


def _prompts(rng: random.Random) -> list[tuple[int, ...]]:
    """Token prompts sharing a few system prompts and chat histories, some under one block."""
    systems = [tuple(rng.randrange(256) for _ in range(rng.randrange(1, 13))) for _ in range(4)]
    prompts = []
    for _ in range(40):
        base = rng.choice(systems + prompts[-8:]) if prompts or rng.random() < 0.8 else ()
        prompts.append(tuple(base) + tuple(rng.randrange(256) for _ in range(rng.randrange(0, 14))))
    return [p for p in prompts if p] or [(1,)]


def _request(tokens: tuple[int, ...], rng: random.Random) -> RoutingRequest:
    salt = rng.choice([None, None, "tenant-b"])
    return RoutingRequest(tuple(block_hashes(list(tokens), BLOCK, salt=salt)), len(tokens), salt=salt,
                          num_output_tokens=rng.choice([0, 16, 2048]), token_ids=tokens if rng.random() < 0.8 else ())


def _run(config: PolicyConfig, seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    policy = PrefixAffinityPolicy(config, clock=clock)
    bases: dict[int, bytes] = {}
    names = [f"replica-{i}" for i in range(6)]
    workers = {name: _Worker(name, rng, bases) for name in names[:3]}
    policy.set_replicas(workers)
    prompts = _prompts(rng)
    in_flight: list[tuple[str, str, RoutingRequest]] = []  # (request id, replica, request)
    for step in range(STEPS):
        clock.now += rng.choice([0.001, 0.01, 0.2, 1.5])
        action = rng.random()
        live = sorted(workers)
        if action < 0.45:  # a decision, as the Ray adapter makes it
            request = _request(rng.choice(prompts), rng)
            candidates = rng.sample(live, rng.randrange(1, len(live) + 1)) if rng.random() < 0.3 else None
            request_id = f"q{step}"
            ranked = policy.rank(request, candidates, request_id=request_id)
            assert ranked and set(ranked) <= set(candidates or live), (ranked, candidates)
            if rng.random() < 0.05:
                assert policy.rank(request, candidates, request_id=request_id)  # asked again (a retry)
            if rng.random() < 0.9:  # routed (rarely to another replica than the first choice)
                chosen = ranked[0] if rng.random() < 0.9 else rng.choice(live)
                policy.on_routed(request, chosen, request_id)
                workers[chosen].serve(request.block_hashes, rng.randrange(0, 3), rng)
                in_flight.append((request_id, chosen, request))
        elif action < 0.6 and in_flight:  # a completion (not always the oldest)
            request_id, _, _ = in_flight.pop(rng.randrange(len(in_flight)))
            policy.on_completed(request_id)
        elif action < 0.64:  # a router that does not share its decisions sent a request here
            replica_id = rng.choice(live)
            workers[replica_id].serve(_request(rng.choice(prompts), rng).block_hashes, rng.randrange(0, 3), rng)
        elif action < 0.68:  # another router's decision, shared
            request = _request(rng.choice(prompts), rng)
            replica_id = rng.choice(live)
            policy.on_peer_routed(request, replica_id, request.token_ids[len(request.block_hashes) * BLOCK:])
            workers[replica_id].serve(request.block_hashes, 0, rng)
        elif action < 0.9:  # a summary; Serve's channel may drop it; a missing base may be fetched
            replica_id = rng.choice(live)
            wire = workers[replica_id].report(clock.now, rng)
            if rng.random() < 0.2:
                continue  # lost
            applied = policy.on_routing_stats(replica_id, wire)
            missing = policy.missing_base(replica_id, wire)
            if not applied and missing is not None and BASE_REF_KEY in wire and rng.random() < 0.7:
                epoch, version = missing
                policy.on_base(replica_id, epoch, version, unpack_block_hashes(bases[wire[BASE_REF_KEY]]))
                policy.on_routing_stats(replica_id, wire)
        elif action < 0.93:  # malformed or empty stats
            bad = rng.choice([None, {}, {"version": "x"}, {"replica_id": 3}, [1, 2], {"block_size": BLOCK}])
            assert policy.on_routing_stats(rng.choice(live), bad) is False
        elif action < 0.96:  # a replica restarts: a new process, an empty cache, a new epoch
            replica_id = rng.choice(live)
            workers[replica_id] = _Worker(replica_id, rng, bases)
        else:  # a replica joins or leaves
            if len(workers) > 1 and (len(workers) == len(names) or rng.random() < 0.5):
                gone = rng.choice(live)
                del workers[gone]
                in_flight = [entry for entry in in_flight if entry[1] != gone or rng.random() < 0.5]
            else:
                joined = rng.choice([n for n in names if n not in workers])
                workers[joined] = _Worker(joined, rng, bases)
            policy.set_replicas(workers)
        policy.check_invariants()
    assert policy.routing_status()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_pinned_config_survives_a_hostile_run(name):
    for seed in range(2):
        _run(PolicyConfig(block_size=BLOCK, **CONFIGS[name]), seed)


@pytest.mark.parametrize("seed", range(12))
def test_the_default_policy_survives_many_hostile_runs(seed):
    _run(PolicyConfig(block_size=BLOCK, max_blocks_per_replica=rng_capacity(seed)), 100 + seed)


def rng_capacity(seed: int) -> int:
    """The router's own bound on a replica's entries, small on some seeds so it trims before any summary does."""
    return [4, 16, 1 << 18][seed % 3]
