"""Micro-benchmark of the cache core: ``python -m cache.bench``.

1. RadixCache ``match``/``insert`` cost for 4,096-token prompts with 10^2 ..
   10^5 entries cached, real mode (a BlockAllocator behind it, the engine's
   flow: match, allocate_with_prefix, insert, free) and simulated mode. The
   entries are shared-prefix groups (a 4,032-token system prompt per group of
   100 entries, then a 64-token unique tail; byte-level vocabulary of 256;
   peak memory in BENCHMARKS.md). The caches for every size are built
   first, then timed in interleaved rounds so machine noise hits all sizes
   alike. Per-op figures are thread CPU time (wall-clock medians are in the
   JSON). Goal: median cost flat in the number of entries (10^4 vs 10^2 <= 1.2).
   The eviction order is the engine's (``--protected-share``, segmented LRU;
   0 for plain LRU).
2. BlockAllocator internal fragmentation for block sizes 8/16/32/64 on the
   Mooncake trace's ``input_length + output_length`` (raw and scaled 1/16)
   and on a chat-like synthetic distribution, 64 sequences at a time.
3. Tenants: one 64-token prompt under each of 10^4 / 10^5 distinct salts
   against a 1,024-token cache (the engine's flow: match, insert), real and
   simulated mode: memory the tree keeps (tracemalloc), live namespaces and
   nodes, and the cost of the router summary's walk (``cached_block_hashes``).
   Goal: memory and walk bounded by the budget and ``max_namespaces``, flat
   in the number of salts ever seen.

Not a test: it prints tables (and ``--json`` writes the figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

from cache.blocks import BlockAllocator
from cache.radix import RadixCache
from cache.segmented_lru import SERVING_PROTECTED_SHARE
from cache.summary import cached_block_hashes
from harness.workloads import read_mooncake

PROMPT_TOKENS = 4096
TAIL_TOKENS = 64
PREFIX_TOKENS = PROMPT_TOKENS - TAIL_TOKENS
ENTRIES_PER_GROUP = 100
BLOCK_SIZE = 16
DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared/traces/mooncake_synthetic_trace.jsonl"


# --------------------------------------------------------------- radix scaling
@dataclass
class Fixture:
    """One cache holding ``num_entries`` prompts, and how to make more like them."""

    num_entries: int
    real: bool
    rng: random.Random
    protected_share: float = 0.0  # the eviction order: plain LRU, or the engine's segmented LRU
    radix: RadixCache = field(init=False)
    allocator: BlockAllocator | None = field(init=False, default=None)
    prefixes: list[list[int]] = field(init=False, default_factory=list)
    tails: list[bytes] = field(init=False, default_factory=list)
    next_seq_id: int = 0

    def __post_init__(self) -> None:
        num_groups = -(-self.num_entries // ENTRIES_PER_GROUP)
        budget = num_groups * PREFIX_TOKENS + self.num_entries * TAIL_TOKENS
        if self.real:
            # every cached block plus room for the sequences in flight
            num_blocks = num_groups * (PREFIX_TOKENS // BLOCK_SIZE) + self.num_entries * (TAIL_TOKENS // BLOCK_SIZE + 1)
            self.allocator = BlockAllocator(num_blocks + 4 * PROMPT_TOKENS // BLOCK_SIZE, BLOCK_SIZE)
        self.radix = RadixCache(budget, BLOCK_SIZE, self.allocator, protected_share=self.protected_share)
        self.prefixes = [list(self.rng.randbytes(PREFIX_TOKENS)) for _ in range(num_groups)]
        for index in range(self.num_entries):
            tail = self.rng.randbytes(TAIL_TOKENS)
            self.tails.append(tail)
            self.serve(self.prefixes[index % num_groups] + list(tail))
        # the tree never evicts while it is built: the budget is what it holds
        assert self.radix.stats.evictions == 0, self.radix.stats

    def new_prompt(self) -> list[int]:
        """A prompt of a random group with a tail never seen before."""
        return self.rng.choice(self.prefixes) + list(self.rng.randbytes(TAIL_TOKENS))

    def cached_prompt(self) -> list[int]:
        index = self.rng.randrange(self.num_entries)
        return self.prefixes[index % len(self.prefixes)] + list(self.tails[index])

    def serve(self, prompt: list[int]) -> tuple[float, float]:
        """The engine's flow for one request; returns ``insert``'s (wall, CPU) seconds."""
        seq_id = None
        block_ids = None
        if self.allocator is not None:
            hit = self.radix.match(prompt)
            num_reused = min(hit.num_tokens, len(prompt) - 1)
            seq_id, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
            prefix = hit.block_ids[: -(-num_reused // BLOCK_SIZE)]
            self.allocator.allocate_with_prefix(seq_id, len(prompt), prefix, num_reused)
            block_ids = self.allocator.block_table(seq_id)
        elapsed = timed(self.radix.insert, prompt, block_ids)
        if seq_id is not None:
            self.allocator.free(seq_id)
        return elapsed


def timed(call, *args) -> tuple[float, float]:
    """(wall, thread CPU) seconds of one call. CPU time leaves out the time the
    process spends descheduled, which on a shared machine dominates the tail."""
    wall, cpu = time.perf_counter(), time.thread_time()
    call(*args)
    return time.perf_counter() - wall, time.thread_time() - cpu


def time_match(fixture: Fixture, prompts: list[list[int]]) -> list[tuple[float, float]]:
    return [timed(fixture.radix.match, prompt) for prompt in prompts]


def summarize(samples: list[tuple[float, float]]) -> dict[str, float]:
    cpu = sorted(c for _, c in samples)
    p99 = cpu[min(len(cpu) - 1, math.ceil(0.99 * len(cpu)) - 1)]
    return {
        "median_us": statistics.median(cpu) * 1e6,
        "p99_us": p99 * 1e6,
        "wall_median_us": statistics.median(w for w, _ in samples) * 1e6,
        "num_samples": len(cpu),
    }


def bench_radix(sizes: list[int], real: bool, rounds: int, ops_per_round: int, seed: int,
                protected_share: float = 0.0) -> dict:
    fixtures = []
    for size in sizes:
        start = time.perf_counter()
        fixtures.append(Fixture(size, real, random.Random(seed + size), protected_share))
        print(f"  built {size:>7,} entries ({'real' if real else 'simulated'}) in {time.perf_counter() - start:5.1f} s", flush=True)
    kinds = ("match_hit_4032", "match_hit_4096", "insert_64_new")
    samples = {(size, kind): [] for size in sizes for kind in kinds}
    for _ in range(rounds):
        for fixture in fixtures:
            size = fixture.num_entries
            samples[size, kinds[0]] += time_match(fixture, [fixture.new_prompt() for _ in range(ops_per_round)])
            samples[size, kinds[1]] += time_match(fixture, [fixture.cached_prompt() for _ in range(ops_per_round)])
            # at budget: each insert evicts one least recently used tail
            samples[size, kinds[2]] += [fixture.serve(fixture.new_prompt()) for _ in range(ops_per_round)]
    for fixture in fixtures:
        fixture.radix.check_invariants()
        if fixture.allocator is not None:
            fixture.allocator.check_invariants()
    return {kind: {size: summarize(samples[size, kind]) for size in sizes} for kind in kinds}


def print_radix(result: dict, sizes: list[int], mode: str) -> None:
    labels = {
        "match_hit_4032": "match, 4,032 of 4,096 cached",
        "match_hit_4096": "match, all 4,096 cached",
        "insert_64_new": "insert, 64 new (evicts 1 LRU tail)",
    }
    header = "".join(f"{f'{s:,} entries':>22}" for s in sizes)
    print(f"\n{mode} mode, per-op thread CPU µs (median / p99):")
    print(f"{'':36}{header}{'10^4/10^2 median':>20}")
    for kind, by_size in result.items():
        cells = "".join(f"{by_size[s]['median_us']:>11.1f} / {by_size[s]['p99_us']:<8.1f}" for s in sizes)
        ratio = ratio_of(by_size, 10_000, 100)
        print(f"{labels[kind]:36}{cells}{'' if ratio is None else f'{ratio:>20.3f}'}")


def ratio_of(by_size: dict, numerator: int, denominator: int) -> float | None:
    if numerator in by_size and denominator in by_size:
        return by_size[numerator]["median_us"] / by_size[denominator]["median_us"]
    return None


# -------------------------------------------------------------- fragmentation
def mooncake_lengths(path: Path, scale: float) -> list[int]:
    return [max(1, round((row.num_prompt_tokens + row.num_output_tokens) * scale)) for row in read_mooncake(path)]


def chat_lengths(num_sequences: int, seed: int) -> list[int]:
    """Chat-like: lognormal prompts (median 200) and answers (median 150), clipped to [1, 8192] each."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_sequences):
        prompt = min(8192, max(1, round(rng.lognormvariate(math.log(200), 1.0))))
        answer = min(8192, max(1, round(rng.lognormvariate(math.log(150), 0.8))))
        out.append(prompt + answer)
    return out


def fragmentation(lengths: list[int], block_size: int, batch_size: int = 64) -> dict[str, float]:
    """Allocate the sequences ``batch_size`` at a time (a running batch at its
    final lengths), read :meth:`BlockAllocator.fragmentation`, free, and sum."""
    batches = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    num_blocks = max(sum(-(-n // block_size) for n in batch) for batch in batches)
    allocator = BlockAllocator(num_blocks, block_size)
    totals = {"allocated_slots": 0, "used_slots": 0, "wasted_slots": 0}
    for batch in batches:
        for seq_id, num_tokens in enumerate(batch):
            allocator.allocate(seq_id, num_tokens)
        result = allocator.fragmentation()
        assert result["used_slots"] == sum(batch)
        for name in totals:
            totals[name] += result[name]
        for seq_id in range(len(batch)):
            allocator.free(seq_id)
    allocator.check_invariants()
    return {
        **totals,
        "wasted_fraction": totals["wasted_slots"] / totals["allocated_slots"],
        "wasted_per_sequence": totals["wasted_slots"] / len(lengths),
    }


def bench_fragmentation(trace: Path, seed: int) -> dict:
    distributions = {}
    if trace.exists():
        distributions["mooncake (input+output)"] = mooncake_lengths(trace, 1.0)
        distributions["mooncake scaled 1/16"] = mooncake_lengths(trace, 1 / 16)
    else:
        print(f"(trace {trace} not found: Mooncake rows skipped)")
    distributions["chat-like lognormal"] = chat_lengths(4000, seed)
    out = {}
    print("\nBlockAllocator internal fragmentation (batches of 64 sequences allocated at their final length):")
    print(f"{'distribution':26}{'n':>6}{'median len':>11}{'block':>7}{'wasted %':>10}{'wasted/seq':>12}")
    for name, lengths in distributions.items():
        out[name] = {"num_sequences": len(lengths), "median_length": statistics.median(lengths), "by_block_size": {}}
        for block_size in (8, 16, 32, 64):
            result = fragmentation(lengths, block_size)
            out[name]["by_block_size"][block_size] = result
            print(
                f"{name:26}{len(lengths):>6}{statistics.median(lengths):>11.0f}{block_size:>7}"
                f"{100 * result['wasted_fraction']:>9.2f}%{result['wasted_per_sequence']:>12.2f}"
            )
    return out


# -------------------------------------------------------------------- tenants
def flood_salts(num_salts: int, real: bool, *, budget: int = 1024, prompt_tokens: int = 64, seed: int = 0) -> dict:
    """One fresh prompt per distinct salt; what the tree keeps afterwards."""
    rng = random.Random(seed)
    tracemalloc.start()
    allocator = BlockAllocator(budget // BLOCK_SIZE + 2 * prompt_tokens // BLOCK_SIZE, BLOCK_SIZE) if real else None
    radix = RadixCache(budget, BLOCK_SIZE, allocator)
    cpu = time.process_time()
    for index in range(num_salts):
        salt = f"tenant-{index}"
        prompt = list(rng.randbytes(prompt_tokens))
        radix.match(prompt, salt)
        if allocator is None:
            radix.insert(prompt, salt=salt)
        else:
            allocator.allocate(index, prompt_tokens)
            radix.insert(prompt, allocator.block_table(index), salt)
            allocator.free(index)
    cpu = time.process_time() - cpu
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    walks = [timed(cached_block_hashes, radix, BLOCK_SIZE) for _ in range(5)]
    radix.check_invariants()
    return {
        "num_salts": num_salts,
        "kept_mib": kept / 2**20,
        "num_namespaces": radix.num_namespaces,
        "num_nodes": radix.num_nodes,
        "summary_walk_ms": statistics.median(c for _, c in walks) * 1e3,
        "traced_us_per_salt": cpu / num_salts * 1e6,
    }


def bench_namespaces(salt_counts: list[int], seed: int) -> dict:
    print("\nTenants: one 64-token prompt per distinct salt, 1,024-token budget, max_namespaces 1,024:")
    print(f"{'mode':11}{'salts':>9}{'kept MiB':>10}{'namespaces':>12}{'nodes':>7}{'walk ms':>9}{'µs/salt*':>10}")
    out: dict = {}
    for mode in ("simulated", "real"):
        out[mode] = [flood_salts(n, mode == "real", seed=seed) for n in salt_counts]
        for row in out[mode]:
            print(
                f"{mode:11}{row['num_salts']:>9,}{row['kept_mib']:>10.3f}{row['num_namespaces']:>12}"
                f"{row['num_nodes']:>7}{row['summary_walk_ms']:>9.3f}{row['traced_us_per_salt']:>10.1f}"
            )
    print("(* CPU per salt under tracemalloc, several times the untraced cost)")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cache.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", default="100,1000,10000,100000", help="comma-separated cache sizes")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds")
    parser.add_argument("--ops-per-round", type=int, default=100)
    parser.add_argument("--modes", default="real,simulated")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--salts", default="10000,100000", help="tenant part: comma-separated salt counts")
    parser.add_argument("--parts", default="radix,fragmentation,tenants", help="which parts to run")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--protected-share", type=float, default=SERVING_PROTECTED_SHARE,
                        help="radix part: the eviction order, the engine's segmented LRU (0: plain LRU)")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    sizes = [int(s) for s in args.entries.split(",")]
    report: dict = {"prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK_SIZE, "protected_share": args.protected_share,
                    "radix": {}}
    for mode in args.modes.split(",") if "radix" in parts else ():
        print(f"RadixCache, {mode} mode, protected share {args.protected_share:g}: building caches", flush=True)
        result = bench_radix(sizes, mode == "real", args.rounds, args.ops_per_round, args.seed, args.protected_share)
        print_radix(result, sizes, mode)
        report["radix"][mode] = result
        gc.collect()
    if "fragmentation" in parts:
        report["fragmentation"] = bench_fragmentation(args.trace, args.seed)
    if "tenants" in parts:
        report["tenants"] = bench_namespaces([int(n) for n in args.salts.split(",")], args.seed)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
