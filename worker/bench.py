"""Worker-engine benchmark on a shared-prefix workload (one run, one machine).

    python -m worker.bench [--groups 4 --prompts-per-group 8 --system-tokens 512 \
        --question-tokens 32 --output-tokens 64 --repeats 3 --threads N] [--json OUT]

G groups × P prompts, each a group's system prompt (S tokens) + its own
question (Q tokens), shuffled, all submitted at once, O generated tokens each
(EOS ignored so every system generates the same count); each system runs
the workload ``--repeats`` times from a cold cache (in interleaved rounds,
after an untimed one) and the best wall time counts (process CPU time is reported too: the machine may be shared). The
same random
Llama (``BENCH_SPEC``, bigger than the test model so compute dominates) runs
through:

  (a) this engine, default and deterministic mode;
  (b) transformers' continuous batching, ``model.generate_batch`` (paged
      cache with block sharing), on the same weights;
  (c) plain ``model.generate``, one request at a time.

Reported: wall time, generated tokens/s, prefill tokens computed against
the lower bound (tokens of the prompts' union trie, each prompt contained in
another needing one more, as the last position is always recomputed), the
issue's looser bound (unique tokens + 1 per request), the ratios, and how
often the engine's tokens / logprobs equal ``worker.reference.generate``'s on
a sample of requests. Not a test: it prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from worker import reference
from worker.config import EngineConfig
from worker.engine import Engine
from worker.model import TinyLlamaSpec, build_tiny_llama, byte_tokenizer
from worker.sampling import SamplingParams

BENCH_SPEC = TinyLlamaSpec(
    hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2, max_position_embeddings=4096
)


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
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(3, 259) for _ in range(system_tokens)]
        prompts += [system + [rng.randrange(3, 259) for _ in range(question_tokens)] for _ in range(prompts_per_group)]
    rng.shuffle(prompts)
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
    """One system's timed runs of the whole workload (cold cache each time)."""

    name: str
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # process CPU time, all threads
    generated_tokens: int = 0
    prefill_tokens: int | None = None

    @property
    def best_wall_s(self) -> float:
        return min(self.wall_s)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.best_wall_s


class EngineSystem:
    """(a) this engine; ``outputs`` keeps the last run's results."""

    def __init__(self, workload: Workload, *, deterministic: bool, max_batch_tokens: int) -> None:
        self.engine = Engine(EngineConfig(
            tiny_llama=BENCH_SPEC, deterministic=deterministic, cache_budget_tokens=65536,
            max_batch_tokens=max_batch_tokens, max_num_seqs=64, max_model_len=2048,
        ))
        self.workload = workload
        self.params = SamplingParams(max_new_tokens=workload.output_tokens, ignore_eos=True, logprobs=True)
        self.run = Run("engine (deterministic)" if deterministic else "engine (default)")
        self.outputs: list = []
        with torch.inference_mode():
            self.engine.generate([5, 6, 7, 8] * 8, 2)  # warm-up

    def once(self) -> None:
        engine = self.engine
        engine.cache.clear()
        before = engine.stats["prefill_tokens"]
        ids = [engine.add_request(prompt, self.params) for prompt in self.workload.prompts]
        results = engine.run(ids)
        self.outputs = [results[i] for i in ids]
        self.run.prefill_tokens = engine.stats["prefill_tokens"] - before
        self.run.generated_tokens = sum(len(r.token_ids) for r in self.outputs)


def _hf_model():
    model = build_tiny_llama(BENCH_SPEC, vocab_size=len(byte_tokenizer())).eval()
    model.requires_grad_(False)
    return model


class ContinuousBatchingSystem:
    """(b) transformers' continuous batching, paged cache with block sharing (page size 16,
    the fastest of the settings tried; its defaults were about 2x slower here)."""

    def __init__(self, workload: Workload, *, max_batch_tokens: int) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model = _hf_model()
        self.workload = workload
        self.generation = GenerationConfig(
            max_new_tokens=workload.output_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        self.cb_config = ContinuousBatchingConfig(
            page_size=16, num_blocks=4096, max_batch_tokens=max_batch_tokens, max_requests_per_batch=64,
            allow_block_sharing=True,
        )
        self.run = Run("transformers generate_batch")
        with torch.inference_mode():
            self._generate([[5, 6, 7, 8] * 8])

    def _generate(self, prompts):
        return self.model.generate_batch(prompts, generation_config=self.generation, continuous_batching_config=self.cb_config)

    def once(self) -> None:
        outputs = self._generate(self.workload.prompts)
        self.run.generated_tokens = sum(len(o.generated_tokens) for o in outputs.values())


class PlainGenerateSystem:
    """(c) plain ``model.generate``, one request at a time."""

    def __init__(self, workload: Workload) -> None:
        self.model = _hf_model()
        self.workload = workload
        self.kwargs = dict(max_new_tokens=workload.output_tokens, min_new_tokens=workload.output_tokens,
                           do_sample=False, pad_token_id=0)
        self.run = Run("transformers generate (one by one)", prefill_tokens=sum(len(p) for p in workload.prompts))
        with torch.inference_mode():
            self.model.generate(torch.tensor([[5, 6, 7, 8] * 8]), **{**self.kwargs, "max_new_tokens": 2, "min_new_tokens": 2})

    def once(self) -> None:
        self.run.generated_tokens = sum(
            self.model.generate(torch.tensor([p]), **self.kwargs).shape[1] - len(p) for p in self.workload.prompts
        )


def time_interleaved(systems: list, repeats: int, warmup_rounds: int) -> None:
    """Each round runs every system once, so slow periods on a shared machine hit all
    of them; the first ``warmup_rounds`` rounds are not timed (first-touch memory)."""
    for _ in range(warmup_rounds):
        for system in systems:
            with torch.inference_mode():
                system.once()
    for _ in range(repeats):
        for system in systems:
            wall, cpu = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                system.once()
            system.run.wall_s.append(time.perf_counter() - wall)
            system.run.cpu_s.append(time.process_time() - cpu)


def equality_with_reference(engine: Engine, prompts: list[list[int]], outputs: list, num_samples: int) -> dict:
    """Share of sampled requests whose tokens (and logprobs) equal the plain server's."""
    same_tokens = same_logprobs = 0
    for prompt, result in list(zip(prompts, outputs, strict=True))[:num_samples]:
        tokens, logprobs = _reference_ignoring_eos(engine, prompt, len(result.token_ids))
        same_tokens += tokens == list(result.token_ids)
        same_logprobs += tokens == list(result.token_ids) and logprobs == list(result.logprobs)
    return {"samples": min(num_samples, len(prompts)), "tokens_equal": same_tokens, "tokens_and_logprobs_equal": same_logprobs}


def _reference_ignoring_eos(engine: Engine, prompt: list[int], num_tokens: int):
    saved = engine.eos_token_ids
    engine.eos_token_ids = ()
    try:
        return reference.generate(engine, prompt, num_tokens, logprobs=True)
    finally:
        engine.eos_token_ids = saved


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--equality-samples", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system; the best wall time counts")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads for every system (default: torch's)")
    parser.add_argument("--skip-baselines", action="store_true", help="engine only (quick check)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = shared_prefix_workload(
        args.groups, args.prompts_per_group, args.system_tokens, args.question_tokens, args.output_tokens, args.seed
    )
    bound, loose_bound = prefill_bounds(workload.prompts)
    print(f"workload: {args.groups} groups x {args.prompts_per_group} prompts, S={args.system_tokens} "
          f"Q={args.question_tokens} O={args.output_tokens}; {sum(map(len, workload.prompts))} prompt tokens, "
          f"lower bound {bound} prefill tokens; torch threads {torch.get_num_threads()}")
    default = EngineSystem(workload, deterministic=False, max_batch_tokens=args.max_batch_tokens)
    det = EngineSystem(workload, deterministic=True, max_batch_tokens=args.max_batch_tokens)
    systems = [default, det]
    if not args.skip_baselines:
        systems += [ContinuousBatchingSystem(workload, max_batch_tokens=args.max_batch_tokens), PlainGenerateSystem(workload)]
    time_interleaved(systems, args.repeats, args.warmup_rounds)
    runs = [system.run for system in systems]
    for run in runs:
        _report(run, bound)
    default_engine, default_out, det_engine, det_out = default.engine, default.outputs, det.engine, det.outputs
    default, det = default.run, det.run
    equality = {
        "default": equality_with_reference(default_engine, workload.prompts, default_out, args.equality_samples),
        "deterministic": equality_with_reference(det_engine, workload.prompts, det_out, args.equality_samples),
    }
    figures = {
        "args": vars(args),
        "model": asdict(BENCH_SPEC),
        "prefill_lower_bound": bound,
        "prefill_loose_bound": loose_bound,
        "runs": {r.name: {"best_wall_s": r.best_wall_s, "wall_s": r.wall_s, "cpu_s": r.cpu_s,
                          "tokens_per_s": r.tokens_per_s, "generated_tokens": r.generated_tokens,
                          "prefill_tokens": r.prefill_tokens} for r in runs},
        "deterministic_over_default_time": det.best_wall_s / default.best_wall_s,
        "deterministic_over_default_cpu": min(det.cpu_s) / min(default.cpu_s),
        "prefill_over_lower_bound": default.prefill_tokens / bound,
        "reference_equality": equality,
    }
    if not args.skip_baselines:
        figures["speedup_vs_generate_batch"] = default.tokens_per_s / runs[2].tokens_per_s
        figures["speedup_vs_generate"] = default.tokens_per_s / runs[3].tokens_per_s
        figures["deterministic_speedup_vs_generate_batch"] = det.tokens_per_s / runs[2].tokens_per_s
    print(json.dumps({k: v for k, v in figures.items() if k not in ("args", "model", "runs")}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


def _report(run: Run, bound: int) -> None:
    prefill = "n/a" if run.prefill_tokens is None else f"{run.prefill_tokens} ({run.prefill_tokens / bound:.3f}x bound)"
    walls = " ".join(f"{w:.2f}" for w in run.wall_s)
    print(f"{run.name:36s} best {run.best_wall_s:7.2f} s ({walls}) cpu {min(run.cpu_s):7.2f} s "
          f"{run.tokens_per_s:8.1f} tok/s  prefill {prefill}", flush=True)


if __name__ == "__main__":
    main()
