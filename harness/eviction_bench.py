"""What the engine's eviction order saves: one real engine serving reused
system prompts among one-off documents, under its adaptive segmented LRU
(``cache_protected_share`` 0.8, the default) and under plain LRU (0), side
by side in one run.

    python -m harness.eviction_bench --shape 125m --requests 160 --rounds 3 --json results/eviction.json

The stream (seeded, the same for both arms): each request is, with
probability ``--doc-share``, a one-off document of ``--doc-tokens`` fresh
tokens (never sent again: summarising, RAG over unique pages), else a chat
turn, one of ``--groups`` system prompts of ``--system-tokens`` + a fresh
``--question-tokens`` question. The cache's budget is ``--budget-tokens``
(the default holds the system prompts once, with room for a document or
two). Requests run one at a time (``Engine.generate``, ``--output-tokens``
each), so the time is the engine's own. Per arm and round: the token hit
rate (reused prompt tokens / prompt tokens), prefill tokens, wall time;
rounds alternate the arms' order on fresh engines. Deterministic mode: the
two arms' outputs must be identical token for token (what is cached never
changes an output), and the run fails if they are not.

Not a test: it prints a table (``--json`` writes the figures).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from harness.workloads import documents_and_chats

ARMS = (("segmented LRU", 0.8), ("plain LRU", 0.0))


def make_stream(num_requests: int, groups: int, system_tokens: int, question_tokens: int, doc_tokens: int,
                doc_share: float, seed: int) -> list[list[int]]:
    """The prompts of :func:`harness.workloads.documents_and_chats` (byte-level token ids 3..258)."""
    sessions = documents_and_chats(random.Random(seed), num_requests, groups, system_tokens, question_tokens,
                                   doc_tokens, doc_share, output_tokens=1, tokens=(3, 259))
    return [list(session.prefix + session.turns[0].question) for session in sessions]


def run_arm(stream: list[list[int]], shape: str, share: float, budget_tokens: int, output_tokens: int) -> dict:
    import torch

    from worker import Engine, EngineConfig
    from worker.bench import MODELS

    torch.set_num_threads(1)
    longest = max(map(len, stream)) + output_tokens
    engine = Engine(EngineConfig(tiny_llama=MODELS[shape], cache_budget_tokens=budget_tokens,
                                 kv_pool_tokens=budget_tokens + 4 * longest, max_batch_tokens=512,
                                 deterministic=True, cache_protected_share=share))
    engine.generate([3] * 8, 1)  # warm-up (first-call costs), not counted
    before = engine.stats
    started = time.perf_counter()
    outputs = [engine.generate(prompt, output_tokens) for prompt in stream]
    wall_s = time.perf_counter() - started
    after = engine.stats
    engine.check_invariants()
    prompt_tokens = sum(map(len, stream))
    return {
        "hit_rate": (after["tokens_saved"] - before["tokens_saved"]) / prompt_tokens,
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "wall_s": wall_s,
        "protected_tokens": after["cache_protected_tokens"],
        "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.eviction_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "bench", "125m"])
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--doc-share", type=float, default=0.5)
    parser.add_argument("--budget-tokens", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    stream = make_stream(args.requests, args.groups, args.system_tokens, args.question_tokens, args.doc_tokens,
                         args.doc_share, args.seed)
    runs: dict[str, list[dict]] = {label: [] for label, _ in ARMS}
    for round_index in range(args.rounds):
        order = ARMS if round_index % 2 == 0 else ARMS[::-1]
        for label, share in order:
            runs[label].append(run_arm(stream, args.shape, share, args.budget_tokens, args.output_tokens))
            print(f"round {round_index}: {label:>14} hit {runs[label][-1]['hit_rate']:.3f} "
                  f"wall {runs[label][-1]['wall_s']:.2f} s", flush=True)
    reference = runs[ARMS[0][0]][0]["outputs"]
    same = all(run["outputs"] == reference for arm in runs.values() for run in arm)
    summary = {}
    for label, _ in ARMS:
        arm = runs[label]
        summary[label] = {key: statistics.median(run[key] for run in arm)
                          for key in ("hit_rate", "prefill_tokens", "wall_s", "protected_tokens")}
    slru, lru = summary[ARMS[0][0]], summary[ARMS[1][0]]
    print(f"{args.requests} requests ({sum(map(len, stream)):,} prompt tokens), shape {args.shape}, "
          f"budget {args.budget_tokens:,} tokens; medians over {args.rounds} rounds")
    print(f"{'arm':>14} {'hit':>6} {'prefill tokens':>15} {'wall s':>8} {'protected':>10}")
    for label, _ in ARMS:
        row = summary[label]
        print(f"{label:>14} {row['hit_rate']:6.3f} {row['prefill_tokens']:15,.0f} {row['wall_s']:8.2f}"
              f" {row['protected_tokens']:10,.0f}")
    print(f"segmented / plain: prefill tokens {slru['prefill_tokens'] / lru['prefill_tokens']:.3f}x, "
          f"wall {slru['wall_s'] / lru['wall_s']:.3f}x; outputs identical: {same}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"setup": {k: v for k, v in vars(args).items() if k != "json"}, "summary": summary,
                       "per_round": {label: [{k: v for k, v in run.items() if k != "outputs"} for run in arm]
                                     for label, arm in runs.items()},
                       "outputs_identical": same}, handle, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
