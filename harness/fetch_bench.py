"""What one prefix fetch costs, phase by phase, through Ray's object store
(issue 13): the owner's export, the transfer, the receiver's import.

    python -m harness.fetch_bench --shape 125m --tokens 1024 --nodes 1 --repeats 4
    python -m harness.fetch_bench --shape 125m --tokens 1024 --nodes 2 --repeats 4 --json results/fetch_bench.json

Two Ray actors, ``owner`` and ``receiver``, each an :class:`AsyncEngine` of
the same model and weights (``--nodes 2``: a ``ray.cluster_utils.Cluster``
of two raylets on this machine, one actor on each, so the bundle crosses two
object stores; ``--nodes 1``: both on one raylet, shared memory). The owner
caches ``repeats`` distinct prefixes of ``--tokens`` positions first; each
repeat fetches one the receiver does not hold, the way a Worker does
(``worker/replica.py``: the receiver calls the owner, the bundle is the call's
return value, then ``AsyncEngine.import_prefix``), once with both engines idle
and once *busy*: each engine serving ``--busy-streams`` requests of
``--busy-prompt`` fresh prompt tokens at a time (full-size prefill steps, as a
loaded replica runs them).

Phases (seconds, per fetch): ``owner_wait`` (the export waiting for the
owner's engine), ``owner_copy`` (the rows out of the pool), ``owner_bundle``
(checksum and record), ``call`` (receiver's wall time of the call minus the
owner's export: the actor call, serialization, the object store and, across
nodes, the network), ``check`` (the receiver's checksum and geometry check),
``import_wait`` / ``import_copy`` (waiting for the receiver's engine, then
the write into its pool and tree), ``total`` (call start to imported). Only
the public AsyncEngine methods run; the phases inside them come from their
``timing`` argument.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict

PHASES = ("owner_wait", "owner_copy", "owner_bundle", "call", "check", "import_wait", "import_copy", "total")


class Endpoint:
    """One engine in its own actor; a background load on demand."""

    def __init__(self, shape: str, pool_tokens: int, max_batch_tokens: int) -> None:
        import torch

        from worker import AsyncEngine, EngineConfig
        from worker.bench import MODELS

        torch.set_num_threads(1)
        self.engine = AsyncEngine(EngineConfig(
            tiny_llama=MODELS[shape], kv_pool_tokens=pool_tokens, cache_budget_tokens=pool_tokens // 2,
            max_batch_tokens=max_batch_tokens, deterministic=False))
        self._load_stop = threading.Event()
        self._load_future = None  # the closed-loop clients of start_load, while they run
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def prefill(self, prompts: list[list[int]]) -> float:
        from worker import SamplingParams

        start = time.perf_counter()
        for prompt in prompts:
            self._run(self.engine.generate(prompt, SamplingParams(max_new_tokens=1)))
        return time.perf_counter() - start

    def start_load(self, num_streams: int, prompt_tokens: int, seed: int) -> None:
        """``num_streams`` closed-loop clients of fresh ``prompt_tokens``-token prompts."""
        from worker import SamplingParams

        rng = random.Random(seed)
        stop = self._load_stop
        stop.clear()

        async def client() -> None:
            while not stop.is_set():
                prompt = [rng.randrange(3, 259) for _ in range(prompt_tokens)]
                await self.engine.generate(prompt, SamplingParams(max_new_tokens=4))

        async def clients() -> None:
            await asyncio.gather(*(client() for _ in range(num_streams)))

        self._load_future = asyncio.run_coroutine_threadsafe(clients(), self._loop)

    def stop_load(self) -> None:
        """Stop start_load's clients and wait for them (nothing to do if none run)."""
        self._load_stop.set()
        if self._load_future is not None:
            self._load_future.result(timeout=120)
            self._load_future = None

    def export(self, prompt: list[int]):
        """The owner's side: ``(bundle, {owner_wait, owner_copy, owner_bundle, owner_export})``."""
        start = time.perf_counter()
        timing: dict = {}
        bundle = self.engine.export_prefix(prompt, None, timing=timing)
        return bundle, {"owner_wait": timing["wait_s"], "owner_copy": timing["copy_s"],
                        "owner_bundle": timing["bundle_s"], "owner_export": time.perf_counter() - start}

    def fetch(self, owner, prompt: list[int]) -> dict:
        """The receiver's side: call the owner, import (checked); every phase timed."""
        import ray

        start = time.perf_counter()
        bundle, owner_timing = ray.get(owner.export.remote(prompt))
        got = time.perf_counter()
        if bundle is None:
            raise RuntimeError("the owner no longer holds the prefix (raise --pool-tokens)")
        timing: dict = {}
        num_new = self.engine.import_prefix(bundle, timing=timing)
        done = time.perf_counter()
        return {**owner_timing, "call": got - start - owner_timing["owner_export"], "check": timing["check_s"],
                "import_wait": timing["wait_s"], "import_copy": timing["copy_s"], "total": done - start,
                "num_new": num_new, "num_bytes": bundle.num_bytes}


def summarize(samples: list[dict]) -> dict:
    out = {}
    for phase in (*PHASES, "owner_export"):
        values = [s[phase] for s in samples if s.get(phase) is not None]
        if values:
            out[phase] = {"median": statistics.median(values), "max": max(values)}
    if samples:
        out["num_bytes"] = samples[0]["num_bytes"]
        out["mb_per_s_end_to_end"] = samples[0]["num_bytes"] / out["total"]["median"] / 1e6
    return out


def run(args) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    cluster = None
    if args.nodes == 2:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"bench_node_0": 1}, "object_store_memory": args.object_store_mb << 20})
        cluster.add_node(num_cpus=2, resources={"bench_node_1": 1}, object_store_memory=args.object_store_mb << 20)
        ray.init(address=cluster.address, logging_level="ERROR")
        placement = ({"bench_node_0": 0.5}, {"bench_node_1": 0.5})
    else:
        ray.init(num_cpus=4, object_store_memory=args.object_store_mb << 20, logging_level="ERROR",
                 include_dashboard=False)
        placement = ({}, {})
    try:
        actor = ray.remote(Endpoint)
        make = dict(num_cpus=0, max_concurrency=4)
        owner = actor.options(resources=placement[0], **make).remote(args.shape, args.pool_tokens, args.max_batch_tokens)
        receiver = actor.options(resources=placement[1], **make).remote(args.shape, args.pool_tokens,
                                                                         args.max_batch_tokens)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, 259) for _ in range(args.tokens)] for _ in range(2 * args.repeats)]
        ray.get(receiver.prefill.remote([prompts[0][:8]]))  # both built and warm
        prefill_s = ray.get(owner.prefill.remote(prompts))
        result = {"args": vars(args), "owner_prefill_s_per_prompt": prefill_s / len(prompts)}
        for state, batch in (("idle", prompts[: args.repeats]), ("busy", prompts[args.repeats:])):
            if state == "busy":
                ray.get([owner.start_load.remote(args.busy_streams, args.busy_prompt, 1),
                         receiver.start_load.remote(args.busy_streams, args.busy_prompt, 2)])
                time.sleep(args.busy_warmup_s)
            samples = []
            for prompt in batch:
                samples.append(ray.get(receiver.fetch.remote(owner, prompt)))
                print(state, {k: round(v, 4) if isinstance(v, float) else v for k, v in samples[-1].items()},
                      file=sys.stderr, flush=True)
            if state == "busy":
                ray.get([owner.stop_load.remote(), receiver.stop_load.remote()])
            result[state] = {"samples": samples, "summary": summarize(samples)}
        return result
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="125m", choices=["tiny", "bench", "125m"])
    parser.add_argument("--tokens", type=int, default=1024, help="prefix positions fetched")
    parser.add_argument("--nodes", type=int, default=1, choices=[1, 2])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--pool-tokens", type=int, default=65536, help="KV pool; half is the cache budget (the busy load must not evict the prefixes)")
    parser.add_argument("--max-batch-tokens", type=int, default=1024, help="the engines' step size (the config's)")
    parser.add_argument("--busy-streams", type=int, default=2)
    parser.add_argument("--busy-prompt", type=int, default=1024)
    parser.add_argument("--busy-warmup-s", type=float, default=3.0)
    parser.add_argument("--object-store-mb", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args)
    for state in ("idle", "busy"):
        summary = result[state]["summary"]
        cells = "  ".join(f"{p} {summary[p]['median']:.3f}" for p in PHASES if p in summary)
        print(f"{state}: {cells}  ->  {summary['mb_per_s_end_to_end']:.0f} MB/s end to end")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
