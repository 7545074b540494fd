"""Worker-engine benchmark on shared-prefix and distinct-prompt workloads (one machine).

    python -m worker.bench [--model bench|tiny|125m] [--workload shared|distinct|both] \
        [--groups 4 --prompts-per-group 8 --system-tokens 512 --question-tokens 32 --output-tokens 64] \
        [--peers static,generate_batch,one_by_one,vllm] [--repeats 3 --threads 2] [--json OUT]

Shared prefix: G groups × P prompts, each a group's system prompt (S tokens)
+ its own question (Q tokens), shuffled. Distinct: G × P prompts of S + Q
tokens sharing nothing. All prompts are submitted at once, O generated
tokens each (greedy, EOS ignored so every system generates the same
count). Each system runs each workload ``--repeats`` times from a cold
cache, in interleaved rounds after ``--warmup-rounds`` untimed ones, so slow
periods on a shared machine hit every system; best and median wall times
are reported (process CPU time too, for systems in this process). The same
random Llama (``--model``: the test model's shape, ``BENCH_SPEC``, or a
~125M-parameter Llama) runs through this engine (default and deterministic
mode) and the peers of worker/bench_peers.py: transformers' static batched
``generate``, its ``generate_batch``, one-by-one ``generate``, and vLLM's
CPU engine (``vllm``: needs scripts/setup-vllm.sh).

Reported: tok/s (best / median), prefill tokens against the lower bound
(tokens of the prompts' union trie, each prompt contained in another
needing one more, as the last position is always recomputed), the ratios,
how many requests' greedy tokens equal the engine's, and how often the
engine's tokens / logprobs equal ``worker.reference.generate``'s on a
sample. Not a test: it prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from harness.workloads import shared_prefix_prompts
from worker import reference
from worker.bench_peers import ContinuousBatchingSystem, Outcome, PlainGenerateSystem, StaticBatchSystem, VllmSystem
from worker.config import EngineConfig
from worker.engine import Engine
from worker.host import OMP_BINDING, omp_is_bound
from worker.model import TinyLlamaSpec
from worker.sampling import SamplingParams

BENCH_SPEC = TinyLlamaSpec(
    hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2, max_position_embeddings=4096
)
# A random Llama of ~125M parameters (12 layers, hidden 768, GQA 12/4, 32k vocabulary).
LLAMA_125M = TinyLlamaSpec(
    hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4,
    max_position_embeddings=8192, vocab_size=32000,
)
MODELS = {"bench": BENCH_SPEC, "tiny": TinyLlamaSpec(), "125m": LLAMA_125M}
PEERS = ("static", "generate_batch", "one_by_one", "vllm")


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    output_tokens: int
    groups: int
    prompts_per_group: int
    system_tokens: int
    question_tokens: int


def shared_prefix_workload(
    groups: int, prompts_per_group: int, system_tokens: int, question_tokens: int, output_tokens: int, seed: int
) -> Workload:
    """``harness.workloads.shared_prefix_prompts`` over the tokenizer's byte ids."""
    shared = shared_prefix_prompts(random.Random(seed), groups, prompts_per_group, system_tokens, question_tokens, (3, 259))
    prompts = [list(p.token_ids) for p in shared]
    return Workload(prompts, output_tokens, groups, prompts_per_group, system_tokens, question_tokens)


def prefill_bounds(prompts: list[list[int]]) -> tuple[int, int]:
    """(lower bound, loose bound) on prefill tokens with an unbounded cache.

    Lower bound: the nodes of the prompts' union trie (unique tokens), plus one
    for each repeat of an identical prompt (its last position is always
    recomputed). Loose bound, the issue's: unique tokens + 1 per request.
    """
    trie: dict = {}
    num_nodes = 0
    ends = []
    for prompt in prompts:
        node = trie
        for token in prompt:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                num_nodes += 1
            node = child
        ends.append(id(node))
    num_repeats = len(ends) - len(set(ends))
    return num_nodes + num_repeats, num_nodes + len(prompts)


@dataclass(slots=True)
class Run:
    """One system's timed runs of one workload (cold cache each time)."""

    name: str
    workload: str
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # process CPU time, all threads (this process only)
    generated_tokens: int = 0
    prefill_tokens: int | None = None
    last: Outcome | None = None

    @property
    def best_wall_s(self) -> float:
        return min(self.wall_s)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.best_wall_s

    @property
    def median_tokens_per_s(self) -> float:
        return self.generated_tokens / statistics.median(self.wall_s)


class EngineSystem:
    """This engine; ``engine`` is kept for the reference check. Only the deterministic engine is
    asked for logprobs (its check is bit-equal logprobs); the default one returns tokens, as the
    peers do, so both sides do the same work."""

    def __init__(self, spec: TinyLlamaSpec, *, deterministic: bool, max_batch_tokens: int, gemm: str = "auto",
                 attention: str = "auto") -> None:
        self.engine = Engine(EngineConfig(
            tiny_llama=spec, deterministic=deterministic, cache_budget_tokens=65536,
            max_batch_tokens=max_batch_tokens, max_num_seqs=64, max_model_len=2048, gemm=gemm,
            attention_kernel=attention,
        ))
        self.name = "engine (deterministic)" if deterministic else "engine (default)"
        if gemm != "auto":
            self.name += f" gemm={gemm}"
        if attention != "auto":
            self.name += f" attention={attention}"
        self.logprobs = deterministic
        with torch.inference_mode():
            self.engine.generate([5, 6, 7, 8] * 8, 2)  # warm-up

    def once(self, workload: Workload) -> Outcome:
        engine = self.engine
        engine.cache.clear()
        before = engine.stats["prefill_tokens"]
        params = SamplingParams(max_new_tokens=workload.output_tokens, ignore_eos=True, logprobs=self.logprobs)
        ids = [engine.add_request(prompt, params) for prompt in workload.prompts]
        results = engine.run(ids)
        outputs = [results[i] for i in ids]
        return Outcome([list(r.token_ids) for r in outputs], prefill_tokens=engine.stats["prefill_tokens"] - before,
                       logprobs=[list(r.logprobs) for r in outputs] if self.logprobs else None)


def time_interleaved(systems: list, workloads: dict[str, Workload], repeats: int, warmup_rounds: int) -> dict:
    """Each round runs every system on every workload once; the first ``warmup_rounds``
    rounds are not timed (first-touch memory). Returns ``{(system, workload): Run}``."""
    runs = {(s.name, w): Run(s.name, w) for s in systems for w in workloads}
    for round_index in range(warmup_rounds + repeats):
        for workload_name, workload in workloads.items():
            for system in systems:
                wall, cpu = time.perf_counter(), time.process_time()
                with torch.inference_mode():
                    outcome = system.once(workload)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                measured = outcome.wall_s if outcome.wall_s is not None else wall
                tag = "warm-up" if round_index < warmup_rounds else f"round {round_index - warmup_rounds + 1}"
                print(f"  {tag:8s} {workload_name:9s} {system.name:40s} {measured:7.2f} s", flush=True)
                if round_index < warmup_rounds:
                    continue
                run = runs[(system.name, workload_name)]
                run.wall_s.append(outcome.wall_s if outcome.wall_s is not None else wall)
                if outcome.wall_s is None:
                    run.cpu_s.append(cpu)
                run.generated_tokens = sum(map(len, outcome.token_ids))
                run.prefill_tokens = outcome.prefill_tokens
                run.last = outcome
    return runs


def equality_with_reference(engine: Engine, prompts: list[list[int]], outcome: Outcome, num_samples: int) -> dict:
    """Share of sampled requests whose tokens (and logprobs, where the run returned them) equal the
    plain server's."""
    same_tokens = same_logprobs = 0
    logprobs_of = outcome.logprobs if outcome.logprobs is not None else [None] * len(prompts)
    for prompt, tokens, logprobs in list(zip(prompts, outcome.token_ids, logprobs_of, strict=True))[:num_samples]:
        ref_tokens, ref_logprobs = _reference_ignoring_eos(engine, prompt, len(tokens))
        same_tokens += ref_tokens == tokens
        same_logprobs += ref_tokens == tokens and ref_logprobs == logprobs
    figures = {"samples": min(num_samples, len(prompts)), "tokens_equal": same_tokens}
    figures["tokens_and_logprobs_equal"] = same_logprobs if outcome.logprobs is not None else "not asked"
    return figures


def _reference_ignoring_eos(engine: Engine, prompt: list[int], num_tokens: int):
    saved = engine.eos_token_ids
    engine.eos_token_ids = ()
    try:
        return reference.generate(engine, prompt, num_tokens, logprobs=True)
    finally:
        engine.eos_token_ids = saved


def build_workloads(args) -> dict[str, Workload]:
    shape = (args.system_tokens, args.question_tokens, args.output_tokens, args.seed)
    workloads = {}
    if args.workload in ("shared", "both"):
        workloads["shared"] = shared_prefix_workload(args.groups, args.prompts_per_group, *shape)
    if args.workload in ("distinct", "both"):
        workloads["distinct"] = shared_prefix_workload(args.groups * args.prompts_per_group, 1, *shape)
    return workloads


def build_peers(names: list[str], spec: TinyLlamaSpec, workloads: dict, args) -> list:
    unknown = set(names) - set(PEERS)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    peers = []
    for name in names:
        if name == "static":
            peers.append(StaticBatchSystem(spec))
        elif name == "generate_batch":
            peers.append(ContinuousBatchingSystem(spec, max_batch_tokens=args.max_batch_tokens,
                                                  output_tokens=args.output_tokens))
        elif name == "one_by_one":
            peers.append(PlainGenerateSystem(spec))
        else:
            peers.append(VllmSystem(spec, workloads, threads=args.threads or torch.get_num_threads(),
                                    max_batch_tokens=args.max_batch_tokens))
    return peers


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--workload", choices=("shared", "distinct", "both"), default="shared")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--equality-samples", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system and workload")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads for every system (default: torch's)")
    parser.add_argument("--peers", default="static,generate_batch,one_by_one", help=f"comma-separated, of {PEERS}")
    parser.add_argument("--no-bind-threads", action="store_true",
                        help="run as a script: leave this process's OpenMP threads unpinned (default: pinned one per "
                             "core, as vLLM pins its own: worker/host.py OMP_BINDING)")
    parser.add_argument("--skip-baselines", action="store_true", help="engine only (quick check)")
    parser.add_argument("--no-deterministic", action="store_true", help="skip the deterministic engine")
    parser.add_argument("--engine-gemm", default="auto", help="the default engine's GEMM: auto, packed, plain")
    parser.add_argument("--engine-attention", default="auto",
                        help="the default engine's attention kernel: auto, native, torch")
    parser.add_argument("--compare-attention", default="",
                        help="also time the default engine with this attention kernel (e.g. torch), interleaved")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    workloads = build_workloads(args)
    bounds = {name: prefill_bounds(w.prompts) for name, w in workloads.items()}
    print(f"model {args.model}; workloads {list(workloads)}: {args.groups} groups x {args.prompts_per_group} prompts, "
          f"S={args.system_tokens} Q={args.question_tokens} O={args.output_tokens}; lower bounds "
          f"{ {n: b[0] for n, b in bounds.items()} } prefill tokens; torch threads {torch.get_num_threads()}, "
          f"OpenMP binding {os.environ.get('OMP_PROC_BIND', 'none')}")
    default = EngineSystem(spec, deterministic=False, max_batch_tokens=args.max_batch_tokens, gemm=args.engine_gemm,
                           attention=args.engine_attention)
    print(f"default engine: attention {default.engine.runner.attention_path}, forward {default.engine.runner.forward_path}")
    systems = [default]
    if not args.no_deterministic:
        systems.append(EngineSystem(spec, deterministic=True, max_batch_tokens=args.max_batch_tokens))
    if args.compare_attention:
        systems.append(EngineSystem(spec, deterministic=False, max_batch_tokens=args.max_batch_tokens,
                                    gemm=args.engine_gemm, attention=args.compare_attention))
    peer_names = [] if args.skip_baselines else [n for n in args.peers.split(",") if n]
    # A timeout's SIGTERM unwinds through the finally below, so a peer's processes are not left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    peers = build_peers(peer_names, spec, workloads, args)
    try:
        runs = time_interleaved(systems + peers, workloads, args.repeats, args.warmup_rounds)
    finally:
        for peer in peers:
            getattr(peer, "close", lambda: None)()
    figures = {"args": vars(args), "model": asdict(spec), "workloads": {}}
    for name, workload in workloads.items():
        bound = bounds[name][0]
        print(f"-- {name}")
        for system in systems + peers:
            _report(runs[(system.name, name)], bound)
        ours = runs[(default.name, name)]
        entry = {
            "prefill_lower_bound": bound,
            "prefill_over_lower_bound": ours.prefill_tokens / bound,
            "runs": {r.name: {"best_wall_s": r.best_wall_s, "wall_s": r.wall_s, "cpu_s": r.cpu_s,
                              "tokens_per_s": r.tokens_per_s, "median_tokens_per_s": r.median_tokens_per_s,
                              "generated_tokens": r.generated_tokens, "prefill_tokens": r.prefill_tokens}
                     for (_, w), r in runs.items() if w == name},
            "engine_over_peer": {}, "greedy_tokens_equal_to_engine": {},
        }
        for peer in peers:
            theirs = runs[(peer.name, name)]
            entry["engine_over_peer"][peer.name] = {
                "best": ours.tokens_per_s / theirs.tokens_per_s,
                "median": ours.median_tokens_per_s / theirs.median_tokens_per_s,
            }
            same = sum(a == b for a, b in zip(ours.last.token_ids, theirs.last.token_ids, strict=True))
            entry["greedy_tokens_equal_to_engine"][peer.name] = f"{same}/{len(workload.prompts)}"
        if not args.no_deterministic:
            det = runs[(systems[1].name, name)]
            entry["deterministic_over_default_time"] = det.best_wall_s / ours.best_wall_s
            entry["reference_equality"] = {
                s.name: equality_with_reference(s.engine, workload.prompts, runs[(s.name, name)].last,
                                                args.equality_samples) for s in systems
            }
        figures["workloads"][name] = entry
        print(json.dumps({k: v for k, v in entry.items() if k != "runs"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


def _report(run: Run, bound: int) -> None:
    prefill = "n/a" if run.prefill_tokens is None else f"{run.prefill_tokens} ({run.prefill_tokens / bound:.3f}x bound)"
    walls = " ".join(f"{w:.2f}" for w in run.wall_s)
    cpu = f"cpu {min(run.cpu_s):7.2f} s" if run.cpu_s else "cpu     n/a"
    print(f"{run.name:40s} best {run.best_wall_s:7.2f} s ({walls}) {cpu} "
          f"{run.tokens_per_s:8.1f} / {run.median_tokens_per_s:8.1f} tok/s (best / median)  prefill {prefill}", flush=True)


if __name__ == "__main__":
    if "--no-bind-threads" not in sys.argv and not omp_is_bound(dict(os.environ)):
        # libgomp reads the binding when torch loads: start again with it set (main() itself never re-runs).
        os.execve(sys.executable, [sys.executable, "-m", "worker.bench", *sys.argv[1:]], {**os.environ, **OMP_BINDING})
    main()
