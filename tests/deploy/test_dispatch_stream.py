"""``Dispatcher.stream_lists`` over a worker stream that sends tokens in lists:
the routes get every item once, in order, and the ingress's latency
histograms see the generation's pace (a list's tokens share the gap before
it), not the transport's bursts."""

from __future__ import annotations

import asyncio

from deploy.dispatch import Dispatcher
from deploy.metrics import IngressMetrics
from worker.messages import WorkerRequest
from worker.results import GenerationResult, TokenEvent
from worker.sampling import SamplingParams


class _ChunkClient:
    """Sends prepared lists, each at its own (fake) time."""

    def __init__(self, clock: list[float], timed_chunks: list[tuple[float, list]]) -> None:
        self._clock, self._timed_chunks = clock, timed_chunks

    async def stream_chunks(self, request):
        for at_s, chunk in self._timed_chunks:
            self._clock[0] = at_s
            yield chunk


def test_tokens_arriving_together_share_the_gap_before_them(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("deploy.dispatch.time.monotonic", lambda: clock[0])
    events = [TokenEvent("r", 10 + index, None, index, replica_id="w1") for index in range(6)]
    result = GenerationResult(tuple(e.token_id for e in events), None, 4, 0, "length", 0.2, request_id="r",
                              replica_id="w1")
    chunks = [(0.2, [events[0]]), (0.26, events[1:4]), (0.30, [events[4]]), (0.38, [events[5], result])]
    metrics = IngressMetrics()
    dispatcher = Dispatcher(_ChunkClient(clock, chunks), metrics, router_block_size=64, retry_after_s=1)
    request = WorkerRequest("r", (1, 2, 3, 4), SamplingParams(max_new_tokens=6), None, ())

    async def main():
        return [item async for items in dispatcher.stream_lists(request) for item in items]

    assert asyncio.run(main()) == [*events, result]
    ttft = metrics.registry.get_sample_value("kvroute_ttft_seconds_sum", {"replica": "w1"})
    assert ttft == 0.2  # the first list, from the request's start
    assert metrics.registry.get_sample_value("kvroute_itl_seconds_count") == 5  # every token after the first
    assert abs(metrics.registry.get_sample_value("kvroute_itl_seconds_sum") - 0.18) < 1e-9  # 0.38 - 0.2
    assert metrics.registry.get_sample_value("kvroute_itl_seconds_bucket", {"le": "0.025"}) == 3  # 3 × 0.02


def test_a_result_splits_its_latency_into_engine_phases_and_the_rest(monkeypatch):
    """The engine's queue / prefill / decode seconds each land in their
    histogram; what the ingress waited beyond them is the outside-engine
    time; vLLM's names get the same figures."""
    clock = [0.0]
    monkeypatch.setattr("deploy.dispatch.time.monotonic", lambda: clock[0])
    result = GenerationResult((10, 11), None, 4, 0, "length", 0.15, request_id="r", replica_id="w1",
                              queue_s=0.05, prefill_s=0.1, decode_s=0.125)
    metrics = IngressMetrics(model_name="m")
    dispatcher = Dispatcher(_ChunkClient(clock, [(0.5, [result])]), metrics, router_block_size=64, retry_after_s=1)
    request = WorkerRequest("r", (1, 2, 3, 4), SamplingParams(max_new_tokens=2), None, ())

    async def main():
        return [item async for items in dispatcher.stream_lists(request) for item in items]

    assert asyncio.run(main()) == [result]
    sample = metrics.registry.get_sample_value
    for phase, seconds in (("queue", 0.05), ("prefill", 0.1), ("decode", 0.125)):
        assert sample("kvroute_engine_phase_seconds_sum", {"replica": "w1", "phase": phase}) == seconds
    assert abs(sample("kvroute_outside_engine_seconds_sum", {"replica": "w1"}) - 0.225) < 1e-9  # 0.5 - 0.275
    assert sample("vllm:request_queue_time_seconds_sum", {"model_name": "m"}) == 0.05
    assert abs(sample("vllm:request_inference_time_seconds_sum", {"model_name": "m"}) - 0.225) < 1e-9


def test_a_result_without_phases_counts_no_outside_engine_time():
    """A result from an engine that did not time its phases (None) adds
    nothing to the phase or outside-engine histograms."""
    metrics = IngressMetrics()
    metrics.observe_result(GenerationResult((1,), None, 2, 0, "length", 0.1, replica_id="w1"), 0.3)
    assert metrics.registry.get_sample_value("kvroute_outside_engine_seconds_count", {"replica": "w1"}) is None
    assert metrics.registry.get_sample_value("kvroute_request_latency_seconds_count", {"replica": "w1"}) == 1
