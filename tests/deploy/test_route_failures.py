"""How the routes answer when the worker side fails: overload (429/503 with
``Retry-After``, before any stream byte), a replica dying (re-dispatched,
then 503), failures mid-stream and in a batch group. A scripted
:class:`WorkerClient` stands in for the replicas; no engine, no Ray."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from deploy.errors import APIError
from deploy.http_app import build_http_app
from deploy.request_builder import ModelBounds, RequestBuilder
from deploy.settings import AppConfig
from deploy.worker_client import Busy, ReplicaFailed
from harness.sse import DONE, sse_events
from worker.model import load_tokenizer
from worker.results import GenerationResult, ItemError, TokenEvent


class ScriptedClient:
    """Each call first pops a scripted failure (if any), then answers as a
    replica named ``r<call number>`` would: ``max_new_tokens`` tokens of id 7.
    ``fail_after_tokens``: a stream raises ``ReplicaFailed`` after that many."""

    def __init__(self, *failures: BaseException, fail_after_tokens: int | None = None) -> None:
        self.failures = list(failures)
        self.fail_after_tokens = fail_after_tokens
        self.num_calls = 0

    def _next(self):
        self.num_calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return f"r{self.num_calls}"

    @staticmethod
    def _result(request, replica_id: str) -> GenerationResult:
        n = request.params.max_new_tokens
        return GenerationResult((7,) * n, None, request.num_prompt_tokens, 0, "length", 0.001, request.request_id,
                                replica_id=replica_id)

    async def generate(self, request):
        return self._result(request, self._next())

    async def stream_chunks(self, request):
        replica_id = self._next()
        result = self._result(request, replica_id)
        for index, token_id in enumerate(result.token_ids):
            if index == self.fail_after_tokens:
                raise ReplicaFailed(1)
            yield [TokenEvent(request.request_id, token_id, None, index, replica_id=replica_id)]
        yield [result]

    async def generate_batch(self, batch):
        replica_id = self._next()
        return [ItemError("queue full", "overloaded") if r.num_prompt_tokens == 3 else self._result(r, replica_id)
                for r in batch.requests]

    async def stats(self):
        return {}


def serve(client: ScriptedClient) -> TestClient:
    config = AppConfig(retry_after_s=2)
    builder = RequestBuilder(config.limits, ModelBounds(vocab_size=259, max_model_len=1024), config.router_block_size)
    return TestClient(build_http_app(config, client, load_tokenizer("tiny-llama"), builder))


BODY = {"prompt_token_ids": [1, 2, 3, 4], "max_new_tokens": 3}


def metric(http, line_start: str) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(line_start)]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error,status,code,reason", [
    (Busy("engine_queue_full", "1024 queued", 2), 429, "engine_overloaded", "engine_queue_full"),
    (Busy("serve_queue_full", "Serve queue", 2), 503, "overloaded", "serve_queue_full"),
])
def test_overload_is_a_status_with_retry_after_never_a_200_stream(stream, error, status, code, reason):
    with serve(ScriptedClient(error)) as http:
        response = http.post("/generate", json={**BODY, "stream": stream})
        assert response.status_code == status and response.headers["retry-after"] == "2"
        assert response.json()["error"]["code"] == code
        assert metric(http, f'kvroute_rejected_total{{reason="{reason}"}}') == 1.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_replica_is_retried_twice_then_503(stream):
    with serve(ScriptedClient(ReplicaFailed(2), ReplicaFailed(2))) as http:
        response = http.post("/generate", json={**BODY, "stream": stream})
        assert response.status_code == 200
        replica_ids = {e["replica_id"] for e in sse_events(response.text)[:-1]} if stream else {response.json()["replica_id"]}
        assert replica_ids == {"r3"} and metric(http, "kvroute_replica_retries_total") == 2.0
    with serve(ScriptedClient(*[ReplicaFailed(2)] * 3)) as http:
        response = http.post("/generate", json={**BODY, "stream": stream})
        assert response.status_code == 503 and response.json()["error"]["code"] == "replica_failed"


def test_a_stream_that_fails_after_its_first_token_ends_with_an_error_event():
    client = ScriptedClient(fail_after_tokens=1)
    with serve(client) as http:
        response = http.post("/generate", json={**BODY, "stream": True})
        assert response.status_code == 200
        events = sse_events(response.text)
        assert events[0]["token_id"] == 7
        assert events[1]["error"]["code"] == "replica_failed" and events[2] == DONE
        assert client.num_calls == 1  # tokens were sent: not re-dispatched
        chunks = sse_events(http.post("/v1/completions", json={
            "model": "tiny-llama", "prompt": "hi", "max_tokens": 3, "stream": True}).text)[:-1]
        assert chunks[-1]["error"]["code"] == "replica_failed"


def test_batch_failures_stay_in_place():
    # group 1 (prompts starting [9]*64) fails as a whole; prompt [5,5,5] is refused by the engine
    group = [[9] * 64 + [i] for i in range(2)]
    body = {"prompts": [group[0], [5, 5, 5], [10**6], group[1]], "max_new_tokens": 2}
    with serve(ScriptedClient(APIError(500, "boom"))) as http:
        outputs = http.post("/generate_batch", json=body).json()["outputs"]
    assert [o.get("error", {}).get("type") for o in outputs[:1] + outputs[3:]] == ["internal_error"] * 2
    assert outputs[1]["error"]["type"] == "rate_limit_error" and outputs[1]["error"]["message"] == "queue full"
    assert "vocabulary" in outputs[2]["error"]["message"]
