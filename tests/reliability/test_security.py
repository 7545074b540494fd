"""The edge as an attacker meets it, in process (the real FastAPI app over a
real deterministic tiny-llama engine, no Ray): authentication on raw header
bytes, what is behind the key, error bodies without internals, tenants that
do not share a cache, honest usage, unique request ids, bounded metrics,
the ingress's own admission. Each was reproduced as a failure first (issue 12).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re

import httpx
import pytest
from fastapi.testclient import TestClient

from deploy.auth import compose_salt
from deploy.http_app import build_http_app
from deploy.request_builder import ModelBounds, RequestBuilder
from deploy.settings import AppConfig, Limits
from harness.engine_client import EngineClient
from worker import AsyncEngine, EngineConfig
from worker.model import load_tokenizer

KEY_A, KEY_B, KEY_C1, KEY_C2 = "sk-tenant-a", "sk-tenant-b", "sk-team-c-1", "sk-team-c-2"
ENGINE = dict(deterministic=True, cache_budget_tokens=4096, kv_pool_tokens=8192, max_batch_tokens=256,
              max_num_seqs=16, max_model_len=1024)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def build(client, **config) -> TestClient:
    config = AppConfig(engine=ENGINE, **config)
    builder = RequestBuilder(config.limits, ModelBounds(256 + 3, 1024), config.router_block_size)
    return TestClient(build_http_app(config, client, load_tokenizer("tiny-llama"), builder),
                      raise_server_exceptions=False)


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(EngineConfig(**ENGINE))
    yield engine
    engine._closed = True  # noqa: SLF001 - daemon thread; stop it without a loop
    engine._wakeup.set()  # noqa: SLF001
    engine._thread.join(timeout=30)  # noqa: SLF001 - gone before the interpreter exits


@pytest.fixture(scope="module")
def http(engine):
    with build(EngineClient(engine), api_keys=(KEY_A, KEY_B, KEY_C1, KEY_C2),
               cache_namespaces={"team-c": (KEY_C1, KEY_C2)}, limits=Limits(max_n=8)) as client:
        yield client


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(35, 130) for _ in range(n)]


def assert_openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    return error


# ------------------------------------------------------------------- auth
@pytest.mark.parametrize("value", [
    "Bearer sécret".encode(), b"Bearer \xff\xfe\x00", "Bearer sk-tenant-aé".encode(), b"Bearer sk-tenant-a\x7f",
    b"Basic c2stdGVuYW50LWE=", b"Bearer", b"Bearer ", b"sk-tenant-a", b"Bearer  " + b"x" * 8000, b"\x80",
    "Bearer ключ".encode(), b"Bearer sk-tenant-a sk-tenant-b",
])
def test_malformed_or_non_ascii_authorization_is_a_401_with_an_openai_body(http, value):
    response = http.post("/generate", json={"prompt_token_ids": [72, 105], "max_new_tokens": 1},
                         headers={"Authorization": value})
    assert assert_openai_error(response, 401)["code"] == "invalid_api_key"


def test_the_bearer_scheme_is_case_insensitive_and_a_valid_key_passes(http):
    for value in (f"Bearer {KEY_A}", f"bearer {KEY_A}", f"BEARER {KEY_B}"):
        response = http.post("/generate", json={"prompt_token_ids": [72, 105], "max_new_tokens": 1},
                             headers={"Authorization": value})
        assert response.status_code == 200, (value, response.text)


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect"])
def test_docs_and_schema_are_behind_the_key(http, path):
    assert_openai_error(http.get(path), 401)
    assert_openai_error(http.get(path, headers={"Authorization": "Bearer wrong"}), 401)
    assert http.get(path, headers=auth(KEY_A)).status_code == 200


def test_health_is_open_and_metrics_are_open_unless_configured(engine, http):
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200
    with build(EngineClient(engine), api_keys=(KEY_A,), metrics_require_key=True) as keyed:
        assert_openai_error(keyed.get("/metrics"), 401)
        assert keyed.get("/metrics", headers=auth(KEY_A)).status_code == 200
        assert keyed.get("/health").status_code == 200


# ------------------------------------------------------- internal errors
class FailingClient(EngineClient):
    """A worker client whose every call fails with a revealing exception."""

    SECRET = "secret-internal-detail /srv/kvroute/worker.py line 42"

    async def generate(self, request):
        raise RuntimeError(self.SECRET)

    async def stream_chunks(self, request):
        raise RuntimeError(self.SECRET)
        yield  # pragma: no cover

    async def stats(self):
        raise KeyError(self.SECRET)


def test_internal_errors_name_a_request_id_and_carry_no_exception_text(engine, caplog):
    caplog.set_level(logging.ERROR)
    with build(FailingClient(engine), api_keys=(KEY_A,)) as client:
        responses = [
            client.post("/generate", json={"prompt_token_ids": [72, 105], "max_new_tokens": 1}, headers=auth(KEY_A)),
            client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2},
                        headers=auth(KEY_A)),
            client.get("/stats", headers=auth(KEY_A)),
        ]
    for response in responses:
        error = assert_openai_error(response, 500)
        for leak in ("secret-internal-detail", "RuntimeError", "KeyError", "Traceback", "worker.py"):
            assert leak not in response.text, response.text
        request_id = re.search(r"request id (\S+)\)", error["message"]).group(1)
        assert request_id in caplog.text  # the details are in the log, under that id
    assert FailingClient.SECRET in caplog.text


# ---------------------------------------------------------------- tenancy
def generate(http, key, prompt, salt=None):
    body = {"prompt_token_ids": prompt, "max_new_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    response = http.post("/generate", json=body, headers=auth(key))
    assert response.status_code == 200, response.text
    return response.json()["cached_tokens"]


def test_each_api_key_is_its_own_cache_namespace(http):
    prompt = tokens(1, 200)
    assert generate(http, KEY_A, prompt) == 0
    assert generate(http, KEY_A, prompt) >= 199  # a's own prompt: a hit
    assert generate(http, KEY_B, prompt) == 0  # b learns nothing of what a sent
    assert generate(http, KEY_B, prompt) >= 199


def test_keys_named_in_one_cache_namespace_share_it(http):
    prompt = tokens(2, 200)
    assert generate(http, KEY_C1, prompt) == 0
    assert generate(http, KEY_C2, prompt) >= 199  # team-c shares by configuration
    assert generate(http, KEY_A, prompt) == 0


def test_cache_salt_partitions_within_a_key_and_never_crosses_keys(http):
    prompt = tokens(3, 200)
    assert generate(http, KEY_A, prompt, salt="s1") == 0
    assert generate(http, KEY_A, prompt, salt="s1") >= 199
    assert generate(http, KEY_A, prompt, salt="s2") == 0
    assert generate(http, KEY_A, prompt) == 0
    assert generate(http, KEY_B, prompt, salt="s1") == 0  # same client salt, other key


def test_composed_salts_are_unambiguous():
    pairs = [("a", "b|s1:c"), ("a|s1:b", "c"), ("a", None), ("a", ""), ("a", "-"), ("ab", "c"), ("a", "bc")]
    composed = [compose_salt(namespace, salt) for namespace, salt in pairs]
    assert len(set(composed)) == len(pairs), composed
    assert compose_salt(None, "x") == "x" and compose_salt(None, None) is None  # no keys: as before


# ------------------------------------------------------------------ usage
@pytest.mark.parametrize("n", [1, 4])
def test_usage_counts_cached_tokens_once_per_prompt(http, n):
    prompt = "The same long prompt, sent twice so the second one hits. " * 6
    body = {"model": "tiny-llama", "prompt": [prompt, prompt + " other"], "max_tokens": 2, "n": n,
            "temperature": 0}
    for _ in range(2):
        usage = http.post("/v1/completions", json=body, headers=auth(KEY_A)).json()["usage"]
    cached, prompt_tokens = usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]
    per_prompt = prompt_tokens // 2
    assert 0 < cached <= prompt_tokens - 2, usage  # each prompt reuses at most len - 1
    assert cached >= 2 * (per_prompt - 64), usage  # and both were counted (the second round hit)


# ------------------------------------------------------------ request ids
def test_request_ids_are_unique_across_ingress_replicas_in_one_process():
    """Two ingress replicas (two builders; on two nodes they may share a pid)."""
    replicas = [RequestBuilder(Limits(), ModelBounds(259, 1024), 16) for _ in range(2)]
    params = replicas[0].sampling(max_new_tokens=1)
    ids = [replica.request((65,), params, None).request_id for _ in range(500) for replica in replicas]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", request_id) for request_id in ids)


# ---------------------------------------------------------------- metrics
def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]


def test_request_metrics_are_labelled_by_route_template_and_bounded(http):
    rng = random.Random(0)
    for i in range(300):
        path = "/" + "/".join(f"{rng.getrandbits(40):x}" for _ in range(rng.randrange(1, 4)))
        http.request(rng.choice(["GET", "POST", "DELETE"]), path, headers=auth(KEY_A) if i % 2 else {})
    http.get("/health")
    text = http.get("/metrics").text
    series = _series(text, "kvroute_requests_total")
    routes = {re.search(r'route="([^"]*)"', line).group(1) for line in series}
    assert routes <= {"/health", "/metrics", "/generate", "/generate_batch", "/v1/completions", "/v1/chat/completions",
                      "/v1/models", "/stats", "/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect", "unmatched"}
    assert "unmatched" in routes and len(series) < 60, len(series)
    total_lines = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    assert total_lines < 600, total_lines


def test_metrics_say_what_they_count_and_speak_vllm(http):
    generate(http, KEY_A, tokens(11, 80))
    text = http.get("/metrics").text
    for name in ("kvroute_cache_hit_requests_total", "kvroute_cache_miss_requests_total",
                 "kvroute_cache_saved_tokens_total", "kvroute_prefill_tokens_total", "kvroute_cache_tokens",
                 "kvroute_kv_free_blocks", "kvroute_kv_blocks",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket"):
        assert _series(text, name), name
    assert re.search(r"# TYPE kvroute_cache_tokens gauge", text)
    assert re.search(r"# TYPE kvroute_cache_saved_tokens(_total)? counter", text)
    total = float(_series(text, "kvroute_kv_blocks")[0].split()[-1])
    free = float(_series(text, "kvroute_kv_free_blocks")[0].split()[-1])
    assert total == 8192 // 16 and 0 <= free <= total
    usage = float(_series(text, "vllm:kv_cache_usage_perc")[0].split()[-1])
    assert usage == pytest.approx(1 - free / total)
    assert 'model_name="tiny-llama"' in _series(text, "vllm:num_requests_running")[0]
    queries = float(_series(text, "vllm:prefix_cache_queries_total")[0].split()[-1])
    hits = float(_series(text, "vllm:prefix_cache_hits_total")[0].split()[-1])
    assert queries >= hits > 0


def test_vllm_names_can_be_switched_off(engine):
    with build(EngineClient(engine), vllm_metrics=False) as client:
        client.post("/generate", json={"prompt_token_ids": [72, 105], "max_new_tokens": 1})
        assert "vllm:" not in client.get("/metrics").text


# -------------------------------------------------------------- admission
class SlowClient(EngineClient):
    """Answers after ``release`` is set: requests pile up in flight."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.release = asyncio.Event()

    async def _run(self, request):  # /generate, the OpenAI routes and every batch item
        await self.release.wait()
        return await super()._run(request)

    async def stats(self):
        return {"w1": None, "w2": None}  # two live workers


def test_admission_refuses_beyond_its_limit_at_once_with_openai_json_and_retry_after(engine):
    client = SlowClient(engine)
    config = AppConfig(engine=ENGINE, max_in_flight_per_worker=3, retry_after_s=2)
    builder = RequestBuilder(config.limits, ModelBounds(259, 1024), 16)
    app = build_http_app(config, client, load_tokenizer("tiny-llama"), builder)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            await http.get("/health")  # any request starts the background read of the worker count
            await asyncio.sleep(0.05)
            body = {"prompt_token_ids": [72, 105], "max_new_tokens": 1}
            admitted = [asyncio.ensure_future(http.post("/generate", json=body)) for _ in range(6)]
            await asyncio.sleep(0.3)
            refused = [await http.post("/generate", json=body) for _ in range(5)]
            health = await http.get("/health")  # not a generation request: never refused
            client.release.set()
            return [await a for a in admitted], refused, health

    admitted, refused, health = asyncio.run(scenario())
    assert [r.status_code for r in admitted] == [200] * 6  # 3 per worker × 2 workers
    for response in refused:
        assert assert_openai_error(response, 429)["code"] == "overloaded"
        assert response.headers["retry-after"] == "2"
    assert health.status_code == 200


def test_admission_weighs_a_request_by_what_it_fans_out_to(engine):
    """The limit counts worker requests: ``n`` choices × prompts, a batch's
    prompts. (Before: each HTTP request counted 1, so n=4 took 4 engine slots
    for one admission slot.) A request heavier than the whole limit runs alone."""
    client = SlowClient(engine)
    config = AppConfig(engine=ENGINE, max_in_flight_per_worker=3, retry_after_s=2, limits=Limits(max_n=8))
    builder = RequestBuilder(config.limits, ModelBounds(259, 1024), 16)
    app = build_http_app(config, client, load_tokenizer("tiny-llama"), builder)
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    one = {"prompt_token_ids": [72, 105], "max_new_tokens": 1}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            async def answer_now(path, body):  # admitted requests wait for the release: None
                task = asyncio.ensure_future(http.post(path, json=body))
                done, _ = await asyncio.wait([task], timeout=3.0)
                return task.result() if done else None

            await http.get("/health")  # starts the background read of the worker count (2: limit 6)
            await asyncio.sleep(0.05)
            held = [asyncio.ensure_future(http.post("/v1/chat/completions", json={**chat, "n": 4}))]  # 4 of 6
            await asyncio.sleep(0.3)
            over = [await answer_now("/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1,
                                                         "n": 3}),  # 4 + 3 > 6
                    await answer_now("/generate_batch", {"prompts": [[72], [105], [33]], "max_new_tokens": 1})]
            held += [asyncio.ensure_future(http.post("/generate_batch", json={"prompts": [[72], [105]],
                                                                                 "max_new_tokens": 1}))]  # 6 of 6
            await asyncio.sleep(0.3)
            over.append(await answer_now("/generate", one))  # 6 + 1 > 6
            client.release.set()
            answered = [await h for h in held]
            alone = await http.post("/v1/chat/completions", json={**chat, "n": 8})  # heavier than 6: runs alone
            return answered, over, alone

    answered, over, alone = asyncio.run(scenario())
    assert [r.status_code for r in answered] == [200, 200], [r.text for r in answered]
    assert len(answered[0].json()["choices"]) == 4 and len(answered[1].json()["outputs"]) == 2
    assert None not in over, "admitted beyond the limit (held until the release)"
    for response in over:
        assert assert_openai_error(response, 429)["code"] == "overloaded"
        assert response.headers["retry-after"] == "2"
    assert alone.status_code == 200 and len(alone.json()["choices"]) == 8


def test_admission_counts_weights_exactly():
    from deploy.admission import Admission

    admission = Admission(max_in_flight_per_worker=3, num_workers=2)  # limit 6
    first, second = admission.try_admit(), admission.try_admit()
    assert admission.try_charge(first, 4) and admission.num_in_flight == 5
    assert not admission.try_charge(second, 3) and second.weight == 1 and admission.num_in_flight == 5
    assert admission.try_charge(second, 2) and admission.num_in_flight == 6
    assert admission.try_admit() is None and admission.num_refused == 2
    assert admission.try_charge(first, 2) and first.weight == 4  # never lowered
    admission.release(first)
    admission.release(second)
    assert admission.num_in_flight == 0
    alone = admission.try_admit()
    assert admission.try_charge(alone, 100) and alone.weight == 6  # charged the limit, runs alone
    with pytest.raises(AssertionError):
        admission.release(alone) or admission.release(alone)
    with pytest.raises(ValueError):
        admission.try_charge(admission.try_admit(), 0)


# ------------------------------------------------------------ edge fuzzing
def test_random_headers_paths_and_bodies_in_process_get_no_5xx(http):
    """The app alone (the live suite sends the same through Serve's proxy):
    arbitrary Authorization / Content-Type / salt bytes, random paths and bodies."""
    rng = random.Random(12)
    paths = ["/generate", "/generate_batch", "/v1/completions", "/v1/chat/completions", "/v1/models", "/stats",
             "/metrics", "/docs", "/openapi.json"]
    statuses: dict[int, int] = {}
    for index in range(300):
        path = rng.choice(paths) if rng.random() < 0.7 else "/x" + "".join(
            rng.choice("ab/%.~é") for _ in range(rng.randrange(1, 30)))
        headers = {
            "Authorization": rng.choice([f"Bearer {KEY_A}".encode(), bytes(rng.randrange(256) for _ in range(40)),
                                         b"Bearer " + bytes(rng.randrange(128, 256) for _ in range(12))]),
            "Content-Type": rng.choice([b"application/json", b"text/plain", bytes(rng.randrange(256) for _ in range(9))]),
            "X-Cache-Salt": bytes(rng.randrange(32, 256) for _ in range(rng.randrange(1, 200))),
        }
        body = rng.choice([b'{"prompt_token_ids": [72, 105], "max_new_tokens": 2}',
                           b'{"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2, "n": 2}',
                           bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))])
        response = http.request(rng.choice(["GET", "POST", "PUT"]), path, content=body, headers=headers)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (path, headers, body, response.text)
        if response.status_code >= 400 and response.request.method != "HEAD":
            assert_openai_error(response, response.status_code)
    assert statuses.get(401, 0) >= 20 and statuses.get(200, 0) >= 10, statuses
