"""Where one engine step's time goes, by kind of work (a script, not a test).

    python -m worker.profile_step [--model 125m] [--context 544] [--batch 32] [--threads 2] \\
        [--steps 5] [--deterministic] [--gemm auto|packed|plain] [--groups 4 --shared-tokens 512] [--table 25]

Fills ``--batch`` sequences of ``--context`` tokens (prompts prefilled
through the engine's own steps; with ``--groups G``, sequence ``i`` shares
the blocks of its first ``--shared-tokens`` positions with the others of
group ``i % G``, as a cached system prompt: the bench's shared-prefix
workload), then profiles ``--steps`` decode steps and
one prefill step of ``--max-batch-tokens`` new tokens (after a
``--context``-token cached prefix) with ``torch.profiler``, and prints each
step's wall time and the share of its operators' self time per kind:
GEMMs, attention, K/V copies (gathers, scatters, concatenations), sampling
(softmax, top-k, argmax) and everything else; "outside operators" is wall
time no operator accounts for (Python, scheduling, the step's numpy
bookkeeping). ``--table`` also prints the top operators.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from worker.bench import MODELS
from worker.config import EngineConfig
from worker.engine import Engine
from worker.sampling import SamplingParams, sample
from worker.step import SeqChunk

KINDS = {
    "gemm": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product",
                  "aten::scatter_reduce", "aten::exp", "aten::index_add", "aten::logsumexp"),
    "kv copies": ("aten::index_select", "aten::index_copy", "aten::cat", "aten::copy_", "aten::index",
                  "aten::clone", "aten::contiguous"),
    "sampling": ("aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax", "aten::argmax",
                 "aten::topk", "aten::max", "aten::sort"),
}


def kind_of(name: str) -> str:
    for kind, prefixes in KINDS.items():
        if any(name.startswith(prefix) for prefix in prefixes):
            return kind
    return "other operators"


def profiled(label: str, fn, table: int) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        wall_us = (time.perf_counter() - start) * 1e6
    shares: dict[str, float] = {}
    for event in prof.key_averages():
        shares[kind_of(event.key)] = shares.get(kind_of(event.key), 0.0) + event.self_cpu_time_total
    shares["outside operators"] = max(0.0, wall_us - sum(shares.values()))
    parts = ", ".join(f"{k} {v / wall_us:5.1%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
    print(f"{label}: {wall_us / 1e3:8.1f} ms  {parts}")
    if table:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=table))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="125m")
    parser.add_argument("--context", type=int, default=544)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--gemm", default="auto")
    parser.add_argument("--groups", type=int, default=0, help="0: every context in blocks of its own")
    parser.add_argument("--shared-tokens", type=int, default=512, help="with --groups: positions a group shares")
    parser.add_argument("--table", type=int, default=0, help="also print the top N operators")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    block_size = 16
    positions = args.context + args.steps + args.max_batch_tokens + 1
    engine = Engine(EngineConfig(
        tiny_llama=spec, deterministic=args.deterministic, gemm=args.gemm, max_batch_tokens=args.max_batch_tokens,
        max_model_len=max(positions, 64), kv_pool_tokens=(args.batch + 1) * (positions + block_size) + 1,
        cache_budget_tokens=0, block_size=block_size, max_num_seqs=max(args.batch, 1),
    ))
    runner, pool = engine.runner, engine.pool
    blocks_per_seq = -(-positions // block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(args.batch + 1)]
    shared_blocks = min(args.shared_tokens, args.context) // block_size if args.groups else 0
    for i in range(args.groups, args.batch if args.groups else 0):  # group members read their group leader's prefix blocks
        tables[i][:shared_blocks] = tables[i % args.groups][:shared_blocks]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 259, (args.context,), generator=generator).tolist()
    with torch.inference_mode():
        for index, table in enumerate(tables):  # fill every context (a shared prefix once), a chunk per step
            first = shared_blocks * block_size if args.groups <= index < args.batch else 0
            for lo in range(first, args.context, args.max_batch_tokens):
                runner.forward([SeqChunk(prompt[lo : lo + args.max_batch_tokens], lo, table, False)], pool)
        params = [SamplingParams(max_new_tokens=1)] * args.batch
        tokens = [5] * args.batch

        def decode_step(position: int) -> None:
            logits = runner.forward([SeqChunk([t], position, tables[i], True) for i, t in enumerate(tokens)], pool)
            sample(logits, params, [None] * args.batch)

        decode_step(args.context)  # warm-up
        print(f"model {args.model}, batch {args.batch}, context {args.context}, threads {torch.get_num_threads()}, "
              f"gemm {runner.gemm}, deterministic {args.deterministic}, groups {args.groups}")
        for step in range(args.steps):
            profiled(f"decode step {step}", lambda: decode_step(args.context + 1 + step), args.table if step == 0 else 0)
        new = [7] * args.max_batch_tokens
        prefill = [SeqChunk(new, args.context, tables[-1], True)]
        profiled(f"prefill {args.max_batch_tokens} after {args.context}", lambda: runner.forward(prefill, pool), args.table)


if __name__ == "__main__":
    main()
