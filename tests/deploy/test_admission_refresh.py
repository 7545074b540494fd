"""The ingress admission's count of live Workers at start-up: before any
Worker has posted its stats the count reads 0, which must not hold the limit
at one Worker's share for a whole refresh period (a burst in the first
seconds after start was refused at half the fleet's capacity)."""

from __future__ import annotations

import asyncio

from deploy.admission import STARTUP_REFRESH_S, Admission, AdmissionGuard


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _get(guard):
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    await guard({"type": "http", "method": "GET", "path": "/health", "headers": []}, receive, send)


def test_a_count_of_zero_keeps_the_last_and_is_asked_again_soon():
    counts = iter([0, 0, 2, 2, 2])
    asked = []

    async def count_workers():
        asked.append(asyncio.get_running_loop().time())
        return next(counts)

    async def main():
        admission = Admission(max_in_flight_per_worker=3)
        guard = AdmissionGuard(_ok, admission, retry_after_s=1, count_workers=count_workers, refresh_period_s=30.0)
        limits = []
        for _ in range(12):  # a request every 0.1 s for 1.2 s, each may trigger a refresh
            await _get(guard)
            await asyncio.sleep(0.1)
            limits.append(admission.limit)
        return limits

    limits = asyncio.run(main())
    assert limits[0] == 3  # 0 live: the last count (1 Worker) stays, not 0 or a refusal of everything
    assert limits[-1] == 6  # both Workers counted within a second, not after the 30-s period
    assert len(asked) == 3 and all(b - a >= STARTUP_REFRESH_S - 0.05 for a, b in zip(asked, asked[1:]))


async def _post(guard):
    statuses = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await guard({"type": "http", "method": "POST", "path": "/generate", "headers": []}, receive, send)
    return statuses[0]


def test_a_refusal_counts_the_workers_again_first_but_not_at_every_refusal():
    """The count said 1 Worker (taken before the second one posted); the
    second request would be refused, so the Workers are counted again: 2,
    and it is admitted. Refusals right after do not count again."""
    counts = iter([1, 2, 2, 2, 2, 2])
    asked = []

    async def count_workers():
        asked.append(1)
        return next(counts)

    async def main():
        release = asyncio.Event()

        async def hold(scope, receive, send):  # an admitted request that stays in flight
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await release.wait()

        admission = Admission(max_in_flight_per_worker=1)
        guard = AdmissionGuard(hold, admission, retry_after_s=1, count_workers=count_workers, refresh_period_s=30.0)
        first = asyncio.ensure_future(_post(guard))  # counts: 1 Worker
        await asyncio.sleep(0.3)
        second = asyncio.ensure_future(_post(guard))  # at the limit of 1: recount -> 2, admitted
        await asyncio.sleep(0.05)
        refused = [await _post(guard) for _ in range(20)]  # at the limit of 2, the count is fresh
        release.set()
        return await first, await second, refused

    first, second, refused = asyncio.run(main())
    assert (first, second) == (200, 200)
    assert refused == [429] * 20 and len(asked) == 2
