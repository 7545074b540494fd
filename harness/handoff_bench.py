"""What the asyncio front adds to a request's time to first token (a script, not a test).

    python -m harness.handoff_bench [--prompt-tokens 64] [--requests 40] [--warmup 10] [--threads 1]

An idle ``AsyncEngine`` with deploy/config.yaml's engine settings answers
``--requests`` fresh prompts one at a time (greedy, one output token); each
result's own ``ttft_s`` (from submission on the event loop to the first
token) is set beside the same prompts run through a plain ``Engine``'s
``step()`` loop, timed around the loop. The difference is the hand-off:
the command queue to the engine thread, the wake-up, the result's way back
to the event loop. ``router.sim_vs_live`` compares a simulated engine
TTFT built from steps alone with the live one (BENCHMARKS.md, "Simulator
against the live cluster").
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from harness.serving import config_engine_args
from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.engine import Engine
from worker.sampling import SamplingParams


def _prompts(rng: random.Random, count: int, num_tokens: int) -> list[list[int]]:
    return [[rng.randrange(3, 259) for _ in range(num_tokens)] for _ in range(count)]


async def _async_ttfts(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    engine = AsyncEngine(config)
    try:
        ttfts = []
        for prompt in prompts:
            result = await engine.generate(prompt, params)
            ttfts.append(result.ttft_s)
            await asyncio.sleep(0.02)  # idle in between: every request finds the engine waiting
        return ttfts
    finally:
        await engine.shutdown()


def _step_times(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    engine = Engine(config)
    times = []
    for prompt in prompts:
        engine.add_request(prompt, params)
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.handoff_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the deployment's Workers use 1)")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.requests or args.prompt_tokens <= 0:
        parser.error("need 0 <= --warmup < --requests and --prompt-tokens > 0")
    torch.set_num_threads(args.threads)
    config = EngineConfig(**config_engine_args())  # the deployment's engine (tiny-llama)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    rng = random.Random(0)
    ttfts = asyncio.run(_async_ttfts(config, _prompts(rng, args.requests, args.prompt_tokens), params))
    steps = _step_times(config, _prompts(rng, args.requests, args.prompt_tokens), params)
    ttfts, steps = ttfts[args.warmup:], steps[args.warmup:]
    async_p50, step_p50 = statistics.median(ttfts), statistics.median(steps)
    print(f"{args.prompt_tokens}-token prompts, {len(ttfts)} timed, {args.threads} torch thread(s), {config.model}")
    print(f"AsyncEngine ttft_s       p50 {async_p50 * 1e3:7.2f} ms   max {max(ttfts) * 1e3:7.2f} ms")
    print(f"Engine.step() loop       p50 {step_p50 * 1e3:7.2f} ms   max {max(steps) * 1e3:7.2f} ms")
    print(f"hand-off (difference)    p50 {(async_p50 - step_p50) * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
