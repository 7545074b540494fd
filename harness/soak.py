"""A bounded soak: mixed valid, invalid, streamed and cancelled traffic
against an app with API keys, for minutes, at a rate the replicas sustain.

    python -m harness.soak --duration-s 300 --json results/soak.json

Starts a private cluster (``harness/serving.py``, 127.0.0.1), measures the
closed-loop capacity of plain ``/generate`` requests unless ``--rate`` is
given, then sends an open-loop mix at ``--load-fraction`` of it. The
generator lowers its own CPU priority (``--nice``) once the cluster is up,
so it takes what the cluster leaves. Figures:

- ``lost``: valid requests that did not complete (after the retries the API
  allows: 429/503 with ``Retry-After``); must be 0;
- ``unexpected``: any answer >= 500 other than an overload 503 with
  ``Retry-After``, or an invalid request not refused with a 4xx OpenAI body;
  must be empty;
- memory: RSS of every process of the cluster, sampled every ``--sample-s``;
  growth from the first sample after warm-up to the end, per process;
- every Worker's idle audit at the end (KV blocks, locks, tree), clean.

The reliability suite runs a short version (``tests/reliability/test_soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

from harness import faults, memprobe
from harness.retry_client import client_session, send

API_KEYS = ("sk-soak-1", "sk-soak-2")
KINDS = (  # (kind, weight)
    ("generate", 25), ("generate_stream", 15), ("completion_stream", 10), ("chat", 10), ("batch", 5),
    ("cancelled", 10), ("invalid_body", 10), ("bad_auth", 8), ("unknown_path", 7),
)
# A small cache budget and KV pool, so the cache is full (steady state) within
# the first minute: a Worker's pool is allocated up front but its pages are
# first touched as blocks are first used, and RSS follows them until then.
SOAK_ENGINE = {"cache_budget_tokens": 8192, "kv_pool_tokens": 16384}
SOAK_APP_ARGS = {"api_keys": list(API_KEYS), "stats_period_s": 0.5,
                 "limits": {"max_prompt_tokens": 1024, "max_new_tokens": 64, "max_body_bytes": 65536,
                            "max_batch_prompts": 8, "max_n": 2}}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(35, 130) for _ in range(n)]


def _auth(rng: random.Random, keys) -> dict:
    return {"Authorization": f"Bearer {rng.choice(keys)}"}


def _valid_generate(rng: random.Random, prefixes: list[list[int]]) -> dict:
    return {"prompt_token_ids": rng.choice(prefixes) + _tokens(rng, rng.randrange(4, 40)),
            "max_new_tokens": rng.randrange(4, 32), "ignore_eos": True}


_INVALID_BODIES = (
    b'{"prompt_token_ids": [1, 2', b'{"prompt_token_ids": [], "max_new_tokens": 1}',
    b'{"prompt_token_ids": [99999], "max_new_tokens": 1}', b'{"prompt_token_ids": [65], "max_new_tokens": 100000}',
    b'{"prompt_token_ids": "abc"}', b'[1, 2, 3]', b'\xff\xfe\x00garbage', b'{"prompt_token_ids": [65], "x": 1}',
    b'{"model": "tiny-llama", "prompt": "hi", "n": 99}', b'{"model": "nope", "prompt": "hi"}',
)


async def _raw(client: aiohttp.ClientSession, method: str, url: str, *, data=None, json_body=None,
               headers=None, timeout_s: float = 60.0) -> tuple[int, bytes, dict]:
    async with client.request(method, url, data=data, json=json_body, headers=headers,
                              timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        return response.status, await response.read(), dict(response.headers)


def _is_openai_error(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
        return bool(error["message"]) and bool(error["type"])
    except (ValueError, KeyError, TypeError):
        return False


async def one_request(client, url: str, kind: str, rng: random.Random, prefixes,
                      keys=API_KEYS) -> tuple[str, str | None]:
    """``(label, problem)``: problem is ``"lost: ..."``, ``"unexpected: ..."`` or None."""
    headers = _auth(rng, keys)
    try:
        if kind in ("generate", "generate_stream"):
            body = _valid_generate(rng, prefixes)
            body["stream"] = kind == "generate_stream"
            outcome = await send(client, url, body, headers=headers, max_attempts=6)
            if outcome.ok:
                return "ok", None
            final = outcome.final
            return final.kind, (f"unexpected: {final.kind} {final.error}" if final.status >= 500 and
                                final.retry_after_s is None else f"lost: {final.kind} {final.error}")
        if kind in ("completion_stream", "chat", "batch"):
            for _ in range(6):
                if kind == "batch":
                    path = "/generate_batch"
                    body = {"prompts": [_valid_generate(rng, prefixes)["prompt_token_ids"] for _ in range(3)],
                            "max_new_tokens": 8}
                elif kind == "chat":
                    path = "/v1/chat/completions"
                    body = {"model": "tiny-llama", "max_tokens": rng.randrange(2, 24), "n": rng.choice([1, 2]),
                            "messages": [{"role": "user", "content": "Tell me about caches " * rng.randrange(1, 6)}]}
                else:
                    path = "/v1/completions"
                    body = {"model": "tiny-llama", "prompt": "Once upon a time " * rng.randrange(1, 8),
                            "max_tokens": rng.randrange(4, 32), "stream": True, "stop": ["\n\n"]}
                status, payload, response_headers = await _raw(client, "POST", url + path, json_body=body,
                                                               headers=headers)
                if status in (429, 503) and "retry-after" in {k.lower() for k in response_headers}:
                    await asyncio.sleep(min(2.0, float(response_headers.get("Retry-After", 1))))
                    continue
                if status != 200:
                    return str(status), f"{'unexpected' if status >= 500 else 'lost'}: {status} {payload[:120]!r}"
                if kind == "completion_stream" and not payload.rstrip().endswith(b"data: [DONE]"):
                    return "broken_stream", f"lost: stream without [DONE] {payload[-120:]!r}"
                if kind == "completion_stream" and b'"error"' in payload:
                    return "stream_error", f"lost: error event {payload[-200:]!r}"
                if kind == "batch" and any("error" in o for o in json.loads(payload)["outputs"]):
                    return "batch_item_error", f"lost: {payload[:200]!r}"
                return "ok", None
            return "retries_exhausted", "lost: retries exhausted"
        if kind == "cancelled":
            body = {**_valid_generate(rng, prefixes), "max_new_tokens": 64, "stream": True}
            async with client.post(url + "/generate", json=body, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=60)) as response:
                if response.status != 200:
                    ok = response.status in (429, 503) and "Retry-After" in response.headers
                    return str(response.status), None if ok else f"unexpected: {response.status}"
                async for raw in response.content:
                    if raw.startswith(b"data: ") and rng.random() < 0.3:
                        break  # hang up mid-stream: the server must cancel the work
            return "cancelled", None
        if kind == "invalid_body":
            path = rng.choice(["/generate", "/v1/completions", "/generate_batch", "/v1/chat/completions"])
            status, payload, _ = await _raw(client, "POST", url + path, data=rng.choice(_INVALID_BODIES),
                                            headers={**headers, "Content-Type": "application/json"})
        elif kind == "bad_auth":
            # any byte a header value may carry (no control characters: those end the header)
            value = bytes(rng.choice([*range(0x20, 0x7F), *range(0x80, 0x100)]) for _ in range(rng.randrange(1, 64)))
            value = rng.choice([b"", b"Bearer ", b"bearer ", b"Basic "]) + value.strip()
            try:
                status, payload, _ = await _raw(client, "POST", url + "/generate",
                                                json_body={"prompt_token_ids": [65], "max_new_tokens": 1},
                                                headers={"Authorization": value.decode("latin-1")})
            except ValueError:  # a header value the client refuses to send
                return "not_sent", None
            if status != 401:
                return str(status), f"unexpected: bad key answered {status} {payload[:120]!r}"
            return "401", None if _is_openai_error(payload) else f"unexpected: 401 body {payload[:120]!r}"
        else:  # unknown_path
            path = "/" + "/".join(f"{rng.getrandbits(32):x}" for _ in range(rng.randrange(1, 4)))
            status, payload, _ = await _raw(client, rng.choice(["GET", "POST"]), url + path, headers=headers)
        if 400 <= status < 500 and _is_openai_error(payload):
            return str(status), None
        return str(status), f"unexpected: {kind} answered {status} {payload[:120]!r}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as error:
        return "transport", f"lost: {kind} {type(error).__name__}: {error}"


def _process_rss_mib(app) -> dict[str, float]:
    """RSS of every process of the cluster, keyed ``pid:name``."""
    out = {}
    for pid in app.ray_pids():
        rss = faults.rss_bytes(pid)
        if rss is None:
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            name = "?"
        out[f"{pid}:{name}"] = round(rss / 2**20, 1)
    return out


def _kv_figures(url: str, key: str) -> dict:
    """Per Worker: KV blocks in use, the MiB of KV pool they cover, tokens the cache holds.
    (A Worker's pool is allocated up front but its pages are first touched as
    blocks are first used, so its RSS grows with the blocks ever used, up to the pool.)"""
    try:
        replicas = faults.replica_stats(url, {"Authorization": f"Bearer {key}"})
    except Exception:  # noqa: BLE001 - a missed sample is a gap, not a failure
        return {}
    out = {}
    for replica_id, stats in replicas.items():
        used = stats.get("kv_blocks_total", 0) - stats.get("kv_blocks_free", 0)
        block_mib = stats.get("kv_block_size", 0) * stats.get("kv_bytes_per_token", 0) / 2**20
        out[f"{stats.get('pid')}"] = {"blocks_used": used, "blocks_used_mib": round(used * block_mib, 1),
                                      "pool_mib": round(stats.get("kv_blocks_total", 0) * block_mib, 1),
                                      "cache_num_tokens": stats.get("cache_num_tokens")}
    return out


async def capacity_rps(url: str, headers: dict, seconds: float = 10.0, concurrency: int = 8, seed: int = 0) -> float:
    rng = random.Random(seed)
    prefixes = [_tokens(rng, 128) for _ in range(8)]
    num_ok, deadline = 0, time.monotonic() + seconds
    async with client_session(concurrency * 2) as client:
        async def worker():
            nonlocal num_ok
            while time.monotonic() < deadline:
                outcome = await send(client, url, _valid_generate(rng, prefixes), headers=headers, max_attempts=1)
                num_ok += outcome.ok
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return num_ok / (time.monotonic() - start)


async def soak(app, *, duration_s: float, rate_rps: float, sample_s: float = 30.0, max_in_flight: int = 256,
               keys=API_KEYS, num_workers: int = 2, seed: int = 0, probe_actors: list | None = None) -> dict:
    """Send the mix for ``duration_s`` at ``rate_rps`` (open loop, at most
    ``max_in_flight`` at once), sample memory, then wait for clean audits.
    ``probe_actors``: Worker actors to measure from inside at each sample
    (``harness/memprobe.py``; the caller has connected and started tracing)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, 128) for _ in range(16)]
    kinds, weights = zip(*KINDS)
    labels: Counter = Counter()
    by_kind: Counter = Counter()
    problems: list[str] = []
    samples: list[dict] = []
    in_flight = asyncio.Semaphore(max_in_flight)
    start = time.monotonic()
    stop_sampling = asyncio.Event()

    async def sampler():
        while not stop_sampling.is_set():
            samples.append({"t_s": round(time.monotonic() - start, 1), "rss_mib": _process_rss_mib(app),
                            "kv": await asyncio.to_thread(_kv_figures, app.url, keys[0])})
            if probe_actors:
                samples[-1]["inside"] = await asyncio.to_thread(memprobe.call_all, probe_actors, memprobe.inside_report)
            try:
                await asyncio.wait_for(stop_sampling.wait(), sample_s)
            except asyncio.TimeoutError:
                pass

    async def run_one(client, kind, request_rng):
        try:
            label, problem = await one_request(client, app.url, kind, request_rng, prefixes, keys)
            labels[f"{kind}:{label}"] += 1
            if problem:
                problems.append(f"{kind}: {problem}"[:300])
        finally:
            in_flight.release()

    sampling = asyncio.ensure_future(sampler())
    tasks = []
    async with client_session(max_in_flight) as client:
        index = 0
        while time.monotonic() - start < duration_s:
            await asyncio.sleep(max(0.0, start + index / rate_rps - time.monotonic()))
            await in_flight.acquire()
            kind = rng.choices(kinds, weights)[0]
            by_kind[kind] += 1
            tasks.append(asyncio.ensure_future(run_one(client, kind, random.Random(rng.getrandbits(64)))))
            index += 1
        await asyncio.gather(*tasks)
    stop_sampling.set()
    await sampling
    samples.append({"t_s": round(time.monotonic() - start, 1), "rss_mib": _process_rss_mib(app),
                    "kv": _kv_figures(app.url, keys[0])})
    end_wall_s = time.time()
    audits = await asyncio.to_thread(faults.wait_for_clean_audits, app.url, num_workers, after_s=end_wall_s,
                                     headers={"Authorization": f"Bearer {keys[0]}"}, timeout_s=60)
    figures = _figures(by_kind, labels, problems, samples, audits, time.monotonic() - start, rate_rps)
    if probe_actors:
        figures["inside_workers"] = [{"t_s": s["t_s"], "workers": s["inside"]} for s in samples if "inside" in s]
        figures["malloc_trim_at_end"] = await asyncio.to_thread(memprobe.call_all, probe_actors, memprobe.inside_trim)
    return figures


def _figures(by_kind, labels, problems, samples, audits, wall_s, rate_rps) -> dict:
    warm = samples[min(1, len(samples) - 1)]["rss_mib"]  # the first sample after warm-up
    middle = samples[len(samples) // 2]["rss_mib"]
    last = samples[-1]["rss_mib"]
    growth = {name: round(last[name] - warm[name], 1) for name in warm if name in last}
    second_half = {name: round(last[name] - middle[name], 1) for name in middle if name in last}
    growing = [name for name, mib in growth.items() if mib >= 4.0]
    return {
        "num_requests": sum(by_kind.values()), "wall_s": round(wall_s, 1), "rate_rps": round(rate_rps, 2),
        "by_kind": dict(by_kind), "outcomes": dict(sorted(labels.items())),
        "num_lost": sum(p.split(": ", 2)[1].startswith("lost") for p in problems),
        "unexpected": [p for p in problems if ": unexpected" in p][:10],
        "lost": [p for p in problems if ": lost" in p][:10],
        "rss_growth_mib": dict(sorted(growth.items(), key=lambda kv: -kv[1])),
        "max_rss_growth_mib": max(growth.values(), default=0.0),
        "rss_growth_second_half_mib": {name: second_half[name] for name in growing if name in second_half},
        "rss_series_mib": {name: [s["rss_mib"].get(name) for s in samples] for name in growing},
        "kv_series": [{"t_s": s["t_s"], **s.get("kv", {})} for s in samples],
        "rss_samples_mib": [{"t_s": s["t_s"], "total": round(sum(s["rss_mib"].values()), 1)} for s in samples],
        "audits_clean": [a.is_clean for a in audits],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--rate", type=float, default=None, help="req/s; default: --load-fraction x capacity")
    parser.add_argument("--load-fraction", type=float, default=0.6)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--nice", type=int, default=10, help="the generator's niceness once the cluster is up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", action="store_true",
                        help="measure the Workers from inside (malloc, gc, tracemalloc diffs; harness/memprobe.py)")
    parser.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an env var for the Worker replicas (runtime_env), e.g. MALLOC_ARENA_MAX=2")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from harness.serving import start_app

    from harness.serving import config_engine_args

    overrides = {}
    if args.worker_env:
        env_vars = dict(item.split("=", 1) for item in args.worker_env)
        overrides["deployment_overrides"] = {"Worker": {"ray_actor_options": {
            "num_cpus": 1, "runtime_env": {"env_vars": env_vars}}}}
    app = start_app(num_cpus=2, args_overrides={**SOAK_APP_ARGS, "engine": config_engine_args(**SOAK_ENGINE)},
                    **overrides)
    try:
        os.nice(args.nice)
        headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
        capacity = None if args.rate else asyncio.run(capacity_rps(app.url, headers, seed=args.seed))
        rate = args.rate or max(1.0, args.load_fraction * capacity)
        actors = None
        if args.probe:
            memprobe.connect(app)
            actors = memprobe.worker_actors()
            memprobe.call_all(actors, memprobe.inside_start)
        figures = asyncio.run(soak(app, duration_s=args.duration_s, rate_rps=rate, sample_s=args.sample_s,
                                   seed=args.seed, probe_actors=actors))
        figures["capacity_rps"] = None if capacity is None else round(capacity, 1)
    finally:
        app.__exit__(None, None, None)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if figures["num_lost"] == 0 and not figures["unexpected"] and all(figures["audits_clean"]) else 1


if __name__ == "__main__":
    sys.exit(main())
