"""Decode step time and peak memory against context length and batch (a script).

    python -m worker.long_context_bench [--model tiny|125m] [--contexts 512,1024,2048,4096,8192] \\
        [--batches 1,8,64] [--max-positions 131072] [--threads 2] [--steps 5] [--source DIR] \\
        [--attention-kernel auto|native|torch] [--json OUT]

For every (context, batch) with batch × context ≤ ``--max-positions``, a
fresh process builds the model runner, a KV pool holding every sequence's
context in blocks of its own (filled with random K/V: step time does not
depend on the values), runs one warm-up decode step (one new token per
sequence at position ``context - 1``), then times ``--steps`` more. Peak
memory: the process's peak resident set during all steps over its resident
set just before the first (Linux ``/proc/self/clear_refs``), i.e. what the
steps allocate beyond the model and the pool: attention's scratch, the
activations and the first step's one-time allocations (kernel caches). ``--source DIR``: run another checkout's engine (e.g. an
older commit, ``git archive C | tar -x -C DIR``) with this script's
driver; it uses only ``ModelRunner(...)``, ``new_pool`` and ``forward``.

The vocabulary is the byte tokenizer's (259) for both model shapes here,
so older checkouts build the same model; the LM head is then a small share
of a step. Not a test: it prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace

from worker.bench import MODELS

CHILD = r"""
import json, statistics, sys, time
args = json.loads(sys.argv[1])
import torch
torch.set_num_threads(args["threads"])
from worker import host
host.tune_malloc()
from worker.model import TinyLlamaSpec
from worker.runner import ModelRunner
from worker.step import SeqChunk

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

spec = TinyLlamaSpec(**args["spec"])
context, batch, block_size = args["context"], args["batch"], 16
kernel = {} if args["attention_kernel"] == "auto" else {"attention_kernel": args["attention_kernel"]}
runner = ModelRunner("tiny-llama", spec, device="cpu", dtype="float32", deterministic=False,
                     max_batch_tokens=max(64, batch), max_positions=context + 8, **kernel)
blocks_per_seq = -(-context // block_size)
pool = runner.new_pool(batch * blocks_per_seq, block_size)
pool.data.normal_()
tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
chunks = [SeqChunk([5], context - 1, table, True) for table in tables]
with torch.inference_mode():
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    runner.forward(chunks, pool)  # warm-up, inside the peak: glibc keeps what it frees for the next step
    times = []
    for _ in range(args["steps"]):
        start = time.perf_counter()
        runner.forward(chunks, pool)
        times.append(time.perf_counter() - start)
peak = status("VmHWM")
g = runner.geometry
kv_bytes = 2 * g.num_layers * g.num_kv_heads * g.head_dim * 4 * context * batch
print(json.dumps({"context": context, "batch": batch, "step_ms": 1e3 * statistics.median(times),
                  "best_step_ms": 1e3 * min(times), "kv_read_mib": kv_bytes / 2**20,
                  "peak_extra_mib": (peak - before) / 2**20, "pool_mib": pool.num_bytes / 2**20}))
"""


def run_one(source: str, spec_fields: dict, context: int, batch: int, threads: int, steps: int,
            attention_kernel: str = "auto") -> dict:
    args = {"spec": spec_fields, "context": context, "batch": batch, "threads": threads, "steps": steps,
            "attention_kernel": attention_kernel}
    env = {**os.environ, "PYTHONPATH": source}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=source, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        return {"context": context, "batch": batch, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "125m"), default="tiny")
    parser.add_argument("--contexts", default="512,1024,2048,4096,8192")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--max-positions", type=int, default=131072, help="skip batch x context above this")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--source", default=os.getcwd(), help="checkout whose engine runs (default: this one)")
    parser.add_argument("--attention-kernel", default="auto",
                        help="the runner's attention_kernel: auto, native, torch (auto: what the checkout chooses)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    spec = replace(MODELS[args.model], vocab_size=None, max_position_embeddings=max(contexts) + 16)
    fields = {k: v for k, v in asdict(spec).items() if k != "vocab_size"}
    rows = []
    print(f"model {args.model} (vocab 259), source {args.source}, threads {args.threads}")
    print(f"{'context':>8} {'batch':>6} {'step ms':>9} {'best ms':>9} {'KV MiB':>8} {'peak+ MiB':>10} {'pool MiB':>9}")
    for batch in (int(b) for b in args.batches.split(",")):
        for context in contexts:
            if batch * context > args.max_positions:
                continue
            row = run_one(args.source, fields, context, batch, args.threads, args.steps, args.attention_kernel)
            rows.append(row)
            if "error" in row:
                print(f"{context:>8} {batch:>6} error {row['error']}", flush=True)
                continue
            print(f"{context:>8} {batch:>6} {row['step_ms']:9.1f} {row['best_step_ms']:9.1f} {row['kv_read_mib']:8.1f} "
                  f"{row['peak_extra_mib']:10.1f} {row['pool_mib']:9.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
