"""Measure a step profile for the simulator from the real engine.

    flock /tmp/kvroute-heavy.lock python -m router.calibrate --json profile.json [--threads 1] [--repeats 5] \
        [--tiny-llama-shape tiny|bench|125m]

Times ``worker.Engine.step()`` on tiny-llama (``--tiny-llama-shape``: the
built-in shape, or one of ``worker.bench.MODELS`` such as the ~125M random
Llama the live fetch runs use) with the serving config's engine
settings (deploy/config.yaml: block 16, 512-token steps, one torch thread per
replica) over prefill chunks of several sizes, decode batches of several
sizes and contexts, and mixed steps, then fits
``step_s = base_s + prefill_token_s × prefill tokens + decode_seq_s × decoding
sequences + context_token_s × context tokens`` by least squares and writes a
:class:`router.batching.StepProfile` (plus the samples and the fit's error).
A tool, not part of the router core: it imports the engine (torch) when run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time


def _engine(threads: int, max_batch_tokens: int, kv_pool_tokens: int, shape: str = "tiny"):
    from worker.bench import MODELS
    from worker.config import EngineConfig
    from worker.engine import Engine

    return Engine(EngineConfig(block_size=16, cache_budget_tokens=65536, kv_pool_tokens=kv_pool_tokens,
                               max_batch_tokens=max_batch_tokens, max_num_seqs=64, num_threads=threads,
                               device="cpu", dtype="float32", tiny_llama=MODELS[shape]))


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [32 + (seed * 7919 + i * 104729) % 200 for i in range(num_tokens)]


def _timed_step(engine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def measure(threads: int = 1, repeats: int = 5, max_batch_tokens: int = 512, shape: str = "tiny") -> list[dict]:
    """Samples ``{prefill, decode, context, step_s}`` (median of ``repeats``)."""
    from worker.sampling import SamplingParams

    samples = []
    seed = iter(range(10**6))
    engine = _engine(threads, max_batch_tokens, 131072, shape)
    for _ in range(3):  # warm-up: first forwards allocate and pack weights
        engine.add_request(_prompt(next(seed), 256), SamplingParams(max_new_tokens=2, ignore_eos=True))
        while engine.has_work():
            engine.step()
    for num_prefill in (16, 64, 128, 256, 384, 512):  # one cold prompt, one chunk
        times = []
        for _ in range(repeats):
            engine.add_request(_prompt(next(seed), num_prefill), SamplingParams(max_new_tokens=1, ignore_eos=True))
            times.append(_timed_step(engine))
            while engine.has_work():
                engine.step()
        samples.append({"prefill": num_prefill, "decode": 0, "context": num_prefill, "step_s": statistics.median(times)})
    for batch in (1, 2, 4, 8, 16, 32):
        for context in (64, 512, 1536):
            if batch * context > 60_000:
                continue
            steps = repeats + 2
            for _ in range(batch):
                engine.add_request(_prompt(next(seed), context), SamplingParams(max_new_tokens=steps + 2, ignore_eos=True))
            while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in engine.scheduler.running):
                engine.step()  # prefill (untimed)
            times = [_timed_step(engine) for _ in range(steps)]
            samples.append({"prefill": 0, "decode": batch, "context": batch * (context + 2 + steps // 2),
                            "step_s": statistics.median(times)})
            while engine.has_work():
                engine.step()
    for batch, num_prefill in ((4, 256), (8, 384), (16, 128)):  # mixed steps
        times = []
        for _ in range(repeats):
            for _ in range(batch):
                engine.add_request(_prompt(next(seed), 256), SamplingParams(max_new_tokens=8, ignore_eos=True))
            while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in engine.scheduler.running):
                engine.step()
            engine.step()
            engine.add_request(_prompt(next(seed), num_prefill), SamplingParams(max_new_tokens=1, ignore_eos=True))
            times.append(_timed_step(engine))
            while engine.has_work():
                engine.step()
        samples.append({"prefill": num_prefill, "decode": batch, "context": batch * 258 + num_prefill,
                        "step_s": statistics.median(times)})
    return samples


def fit(samples: list[dict]) -> tuple[list[float], float]:
    """Non-negative least squares of step_s on (1, prefill, decode, context); (coefficients, max relative error)."""
    import numpy as np

    rows = np.array([[1.0, s["prefill"], s["decode"], s["context"]] for s in samples])
    target = np.array([s["step_s"] for s in samples])
    weights = 1.0 / target  # relative error: small steps count as much as large ones
    active = [0, 1, 2, 3]
    while True:
        coef, *_ = np.linalg.lstsq(rows[:, active] * weights[:, None], target * weights, rcond=None)
        if (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))  # drop a negative term and refit
    full = [0.0] * 4
    for index, value in zip(active, coef):
        full[index] = float(value)
    predicted = rows @ np.array(full)
    return full, float(np.max(np.abs(predicted - target) / target))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--kv-capacity-tokens", type=int, default=131072 - 65536)
    parser.add_argument("--tiny-llama-shape", default="tiny", choices=("tiny", "bench", "125m"),
                        help="the random Llama's shape (worker.bench.MODELS; tiny: the built-in default)")
    args = parser.parse_args(argv)
    from router.batching import StepProfile

    started = time.time()
    samples = measure(args.threads, args.repeats, args.max_batch_tokens, args.tiny_llama_shape)
    (base, prefill, decode, context), max_error = fit(samples)
    profile = StepProfile(base, prefill, decode, context, args.max_batch_tokens, args.kv_capacity_tokens,
                          name=("tiny-llama" if args.tiny_llama_shape == "tiny" else f"llama-{args.tiny_llama_shape}")
                          + f"-cpu-{args.threads}t",
                          source=f"python -m router.calibrate on {platform.node()} ({platform.processor() or 'cpu'}), "
                                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    out = {**profile.to_dict(), "samples": samples, "max_relative_error": max_error,
           "calibration_s": time.time() - started}
    with open(args.json, "w") as handle:
        json.dump(out, handle, indent=2)
    print(f"step_s = {base * 1e3:.3f} ms + {prefill * 1e6:.2f} us/prefill token + {decode * 1e6:.1f} us/decode "
          f"+ {context * 1e9:.1f} ns/context token (max error {max_error:.0%}, {len(samples)} samples, "
          f"{out['calibration_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
