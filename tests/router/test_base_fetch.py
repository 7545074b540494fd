"""router.base_fetch: a router that missed a stream's base fetches it through
the handle the delta names, once, and applies the replica's latest delta."""

import asyncio

from cache.summary import BASE_REF_KEY, CacheSummary, SummaryStream, pack_block_hashes
from router import PolicyConfig, PrefixAffinityPolicy
from router.base_fetch import BaseFetcher

BLOCK = 4


def full(version, hashes):
    return CacheSummary("r0", version, float(version), BLOCK, frozenset(hashes))


class Handle:
    """An awaitable standing in for a Ray ObjectRef (counts how often it is awaited)."""

    def __init__(self, value):
        self.value = value
        self.awaited = 0
        self.release = asyncio.Event()

    def __await__(self):
        return self._get().__await__()

    async def _get(self):
        self.awaited += 1
        await self.release.wait()
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def _stream_wires(states, handle_for):
    """Routing-stats dicts as ``cache.summary_sender`` makes them: each delta names its base."""
    stream = SummaryStream("r0@1", max_periods=3, cumulative=True, by_reference=True)
    wires = []
    for version, state in enumerate(states, start=1):
        sent = stream.encode(full(version, state))
        wire = sent.to_dict()
        if sent.is_delta:
            wire[BASE_REF_KEY] = handle_for(stream.base_version, stream.base_hashes)
        wires.append(wire)
    return wires


def _setup():
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK), clock=lambda: 0.0)
    policy.set_replicas(["r0", "r1"])
    tasks = []
    fetcher = BaseFetcher(policy, lambda coro: tasks.append(asyncio.get_running_loop().create_task(coro)), timeout_s=5)
    return policy, fetcher, tasks


def _held(policy):
    return {h for h in range(100_000) if policy.index.holds("r0", h)}


def test_a_missed_base_is_fetched_once_and_the_latest_delta_applied():
    async def run():
        policy, fetcher, tasks = _setup()
        states = [frozenset(range(i, i + 40)) for i in range(7)]
        handles = {}
        wires = _stream_wires(states, lambda v, h: handles.setdefault(v, Handle(pack_block_hashes(h))))
        assert not fetcher.on_routing_stats("r0", wires[-2])  # starts the fetch
        assert not fetcher.on_routing_stats("r0", wires[-1])  # same base: no second fetch
        assert len(tasks) == 1 and _held(policy) == set()
        handle = handles[wires[-1]["bv"]]
        handle.release.set()
        await asyncio.gather(*tasks)
        assert handle.awaited == 1 and fetcher.num_fetched == 1
        assert _held(policy) == states[-1]  # the latest delta, not the one that started the fetch
        policy.check_invariants()

    asyncio.run(run())


def test_a_failed_fetch_is_dropped_and_a_later_delta_fetches_again():
    async def run():
        policy, fetcher, tasks = _setup()
        states = [frozenset(range(i, i + 40)) for i in range(4)]
        broken = Handle(RuntimeError("owner died"))
        wires = _stream_wires(states, lambda v, h: broken)
        fetcher.on_routing_stats("r0", wires[-1])
        broken.release.set()
        await asyncio.gather(*tasks)
        assert fetcher.num_failed == 1 and _held(policy) == set()
        good = Handle(pack_block_hashes(states[0]))
        good.release.set()
        wire = dict(wires[-1], **{BASE_REF_KEY: good})
        fetcher.on_routing_stats("r0", wire)
        await asyncio.gather(*tasks)
        assert fetcher.num_fetched == 1 and _held(policy) == states[-1]

    asyncio.run(run())


def test_garbage_behind_the_handle_is_a_failed_fetch_not_an_error():
    async def run():
        policy, fetcher, tasks = _setup()
        states = [frozenset(range(i, i + 40)) for i in range(3)]
        bad = Handle(b"12345")  # not a multiple of 8 bytes
        bad.release.set()
        fetcher.on_routing_stats("r0", _stream_wires(states, lambda v, h: bad)[-1])
        await asyncio.gather(*tasks)
        assert fetcher.num_failed == 1 and _held(policy) == set()

    asyncio.run(run())


def test_summaries_without_a_handle_never_fetch():
    async def run():
        policy, fetcher, tasks = _setup()
        stream = SummaryStream("r0@1", max_periods=30)
        wires = [stream.encode(full(v, range(v, v + 30))).to_dict() for v in (1, 2, 3)]
        assert fetcher.on_routing_stats("r0", wires[0])
        assert not fetcher.on_routing_stats("r0", wires[2])  # a chained delta after a gap: waits
        assert tasks == []

    asyncio.run(run())


def test_replicas_that_left_are_forgotten():
    async def run():
        policy, fetcher, tasks = _setup()
        for replica_id in ("r0", "r1"):
            fetcher.on_routing_stats(replica_id, {})
        fetcher.retain({"r1"})
        assert set(fetcher.latest) == {"r1"}
        fetcher.forget("r1")
        assert fetcher.latest == {}

    asyncio.run(run())
