"""Micro-benchmark: the ingress's CPU per streamed token, route to ASGI message.

    python -m harness.sse_bench --tokens 256 --per-list 1 4 8 --json results/sse-bench.json

The real ingress app (``deploy.http_app.build_http_app``: middleware, auth,
routes, dispatcher, detokenizer, SSE formatting, Starlette's streaming
response) is called as an ASGI app in this process, over a
:class:`ReplayClient` that answers every request at once with a fixed output
in lists of ``--per-list`` tokens, as a Worker sends them under
``stream_interval_ms`` (1 = a message per token). No Ray, no proxy, no
sockets: what is timed is only what the Ingress replica's event loop does
for a stream. The figure is process CPU microseconds per output token (best
of ``--repeats``), with the number of ASGI body messages and SSE events
per request, for ``/v1/chat/completions``, ``/v1/completions`` and
``/generate``, each with ``stream: true``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator

from worker.messages import WorkerBatch, WorkerRequest
from worker.results import GenerationResult, ItemError, ReplicaStats, TokenEvent

ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")


class ReplayClient:
    """A :class:`~deploy.worker_client.WorkerClient` answering every request
    with ``output`` (token ids, each with logprob -0.5), streamed in lists of
    ``per_list`` tokens, the result with the last list."""

    def __init__(self, output: list[int], per_list: int) -> None:
        self.output = output
        self.per_list = per_list

    def _result(self, request: WorkerRequest) -> GenerationResult:
        return GenerationResult(tuple(self.output), tuple(-0.5 for _ in self.output), request.num_prompt_tokens, 0,
                                "length", 0.001, request.request_id, replica_id="replay")

    async def generate(self, request: WorkerRequest) -> GenerationResult:
        return self._result(request)

    async def stream_chunks(self, request: WorkerRequest) -> AsyncIterator[list[TokenEvent | GenerationResult]]:
        events = [TokenEvent(request.request_id, token, -0.5, index, replica_id="replay")
                  for index, token in enumerate(self.output)]
        for start in range(0, len(events), self.per_list):
            chunk: list = events[start : start + self.per_list]
            if start + self.per_list >= len(events):
                chunk.append(self._result(request))
            yield chunk
            await asyncio.sleep(0)  # the next list arrives in a later loop turn, as from Ray

    async def generate_batch(self, batch: WorkerBatch) -> list[GenerationResult | ItemError]:
        return [self._result(r) for r in batch.requests]

    async def stats(self) -> dict[str, ReplicaStats]:
        return {}


def build(per_list: int, num_tokens: int):
    from deploy.http_app import build_http_app
    from deploy.request_builder import ModelBounds, RequestBuilder
    from deploy.settings import AppConfig
    from worker.model import load_tokenizer

    config = AppConfig()
    tokenizer = load_tokenizer(config.model)
    text = "The quick brown fox jumps over the lazy dog. " * (num_tokens // 8 + 1)
    output = list(tokenizer.encode(text, add_special_tokens=False))[:num_tokens]
    bounds = ModelBounds(max_model_len=4096, vocab_size=len(tokenizer))
    builder = RequestBuilder(config.limits, bounds, config.router_block_size)
    return build_http_app(config, ReplayClient(output, per_list), tokenizer, builder)


def body_for(route: str, num_tokens: int) -> dict:
    if route == "/generate":
        return {"prompt_token_ids": list(range(65, 97)), "max_new_tokens": num_tokens, "stream": True}
    common = {"model": "tiny-llama", "max_tokens": num_tokens, "stream": True, "ignore_eos": True}
    if route == "/v1/completions":
        return {**common, "prompt": "Once upon a time there was a fox"}
    return {**common, "messages": [{"role": "user", "content": "Once upon a time there was a fox"}]}


async def call(app, route: str, body: bytes) -> tuple[int, int, int]:
    """(status, body messages, SSE events) of one request through ``app``."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": route, "raw_path": route.encode(), "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                               (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent_body = False
    never = asyncio.Event()

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the client stays connected
        return {"type": "http.disconnect"}

    status, messages, events = 0, 0, 0

    async def send(message):
        nonlocal status, messages, events
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body"):
            messages += 1
            events += message["body"].count(b"data: ")

    await app(scope, receive, send)
    return status, messages, events


async def measure(app, route: str, num_tokens: int, requests: int, concurrency: int) -> dict:
    body = json.dumps(body_for(route, num_tokens)).encode()
    status, messages, events = await call(app, route, body)  # warm-up; also checks the answer
    if status != 200:
        raise SystemExit(f"{route} answered {status}")
    started = time.process_time()
    for _ in range(requests // concurrency):
        await asyncio.gather(*(call(app, route, body) for _ in range(concurrency)))
    cpu = time.process_time() - started
    done = requests // concurrency * concurrency
    return {"route": route, "cpu_us_per_token": 1e6 * cpu / (done * num_tokens),
            "cpu_ms_per_request": 1e3 * cpu / done, "messages_per_request": messages, "events_per_request": events}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--per-list", type=int, nargs="+", default=[1, 4, 8], help="tokens per message from the Worker")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--routes", nargs="+", default=list(ROUTES))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for per_list in args.per_list:
        app = build(per_list, args.tokens)
        for route in args.routes:
            runs = [asyncio.run(measure(app, route, args.tokens, args.requests, args.concurrency)) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["cpu_us_per_token"])
            row = {**best, "per_list": per_list, "tokens": args.tokens,
                   "runs_us_per_token": [round(r["cpu_us_per_token"], 1) for r in runs]}
            rows.append(row)
            print(f"{route:22s} tokens/list {per_list:2d}: {row['cpu_us_per_token']:7.1f} µs/token "
                  f"({row['cpu_ms_per_request']:.1f} ms/request), {row['messages_per_request']} messages, "
                  f"{row['events_per_request']} events per request; runs {row['runs_us_per_token']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
