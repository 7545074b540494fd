"""Replay a generated workload over many workload seeds; report each
policy's means with their standard errors, and paired differences.

    python -m router.seed_sweep --workload-seeds N [--jobs J] [--against SWEEP.json] <router.simulate's arguments>

Seed ``s`` (``--seed`` .. ``--seed + N - 1``) generates the workload (which
groups, chats and arrival times) and seeds the randomised baselines, as
``python -m router.simulate --seed s`` does. One workload seed is one sample
of the workload, so a figure over a few seeds carries noise that a goal's
margin may be smaller than: the sweep reports, per policy and figure, the
mean, its standard error (sample sd / sqrt(N)), the minimum and the maximum;
and, because every policy replays the same workloads, the paired difference
of every policy from the first one named (mean and standard error of the
per-seed differences, far tighter than the two means' errors). With
``--against`` the pairs are this sweep's and an earlier sweep's runs of the
same policy on the same seeds (e.g. 2 routers against 1).

A trace (``--trace``) is one workload whatever the seed: there the seeds vary
only the baselines' tie-breaks and the simulator's own randomness.

Writes ``{"setup", "global_lru_hit_rate", "ttft_p99_floor_s", "policies":
{NAME: {FIGURE: {"mean", "se", "min", "max"}}}, "paired": {NAME: {FIGURE:
{"mean", "se"}}}, "per_seed": {NAME: {FIGURE: [...]}}}``. Closed-loop sweeps
(``--arrivals closed``) also keep, per policy and seed, the one-cache LRU
bound over the order that policy's requests were sent
(``global_lru_hit_rate_as_sent``), and print each policy's hit less it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from router.simulate import build_parser, build_run, simulate, workload_kind

FIGURES = ("hit_rate", "load_imbalance", "ttft_p50_s", "ttft_p99_s")
# closed-loop runs only: the one-cache bound over the order each policy's requests were sent (router.simulate)
AS_SENT = "global_lru_hit_rate_as_sent"


@dataclass(frozen=True)
class Spread:
    """Mean, standard error of the mean, minimum and maximum of samples."""

    mean: float
    se: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Spread":
        """``samples``' spread; the error is 0 for one sample (ValueError for none)."""
        if not samples:
            raise ValueError("no samples")
        n = len(samples)
        mean = sum(samples) / n
        var = sum((x - mean) ** 2 for x in samples) / (n - 1) if n > 1 else 0.0
        return cls(mean, math.sqrt(var / n), min(samples), max(samples))

    def to_dict(self) -> dict:
        return {"mean": self.mean, "se": self.se, "min": self.min, "max": self.max}


def paired(samples: Sequence[float], against: Sequence[float]) -> dict:
    """Mean and standard error of ``samples[i] - against[i]`` (same seeds, same order)."""
    if len(samples) != len(against):
        raise ValueError(f"cannot pair {len(samples)} samples with {len(against)}")
    spread = Spread.of([a - b for a, b in zip(samples, against)])
    return {"mean": spread.mean, "se": spread.se}


def _run_seed(args: argparse.Namespace, seed: int) -> dict:
    seeded = argparse.Namespace(**{**vars(args), "seed": seed})
    workload, config, names = build_run(seeded)
    return simulate(workload, config, names, seeds=(seed,))


def sweep(args: argparse.Namespace, num_seeds: int, jobs: int = 1) -> dict:
    """Every seed's replay of ``args`` (a parsed simulate command line), merged."""
    if num_seeds < 1:
        raise ValueError(f"--workload-seeds must be >= 1, got {num_seeds}")
    seeds = list(range(args.seed, args.seed + num_seeds))
    if jobs > 1 and num_seeds > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_run_seed, [args] * num_seeds, seeds))
    else:
        results = [_run_seed(args, seed) for seed in seeds]
    return merge(results, seeds)


def merge(results: list[dict], seeds: list[int]) -> dict:
    """One sweep's summary of per-seed :func:`router.simulate.simulate` results."""
    names = list(results[0]["policies"])
    figures_of = {name: FIGURES + ((AS_SENT,) if all(AS_SENT in r["policies"][name] for r in results) else ())
                  for name in names}
    per_seed = {name: {figure: [r["policies"][name][figure] for r in results] for figure in figures_of[name]}
                for name in names}
    first = names[0]
    return {
        "setup": {**results[0]["setup"], "seeds": None, "workload_seeds": seeds},
        "global_lru_hit_rate": Spread.of([r["global_lru_hit_rate"] for r in results]).to_dict(),
        "ttft_p99_floor_s": Spread.of([r["ttft_p99_floor_s"] for r in results]).to_dict(),
        "policies": {name: {figure: Spread.of(values).to_dict() for figure, values in figures.items()}
                     for name, figures in per_seed.items()},
        "paired": {name: {figure: paired(per_seed[name][figure], per_seed[first][figure]) for figure in FIGURES}
                   for name in names[1:]},
        "paired_with": first,
        "per_seed": per_seed,
    }


def pair_against(summary: dict, earlier: dict) -> dict:
    """Per policy both sweeps ran, this sweep's figures less ``earlier``'s, seed by seed."""
    if summary["setup"]["workload_seeds"] != earlier["setup"]["workload_seeds"]:
        raise ValueError("the two sweeps ran different workload seeds")
    shared = [name for name in summary["per_seed"] if name in earlier["per_seed"]]
    if not shared:
        raise ValueError("the two sweeps share no policy")
    return {name: {figure: paired(summary["per_seed"][name][figure], earlier["per_seed"][name][figure])
                   for figure in FIGURES} for name in shared}


def print_sweep(summary: dict) -> None:
    seeds = summary["setup"]["workload_seeds"]
    lru, floor = summary["global_lru_hit_rate"], summary["ttft_p99_floor_s"]
    print(f"workload seeds {seeds[0]}..{seeds[-1]} ({len(seeds)}); means ± standard error")
    print(f"global LRU hit rate {lru['mean']:.4f} ± {lru['se']:.4f}, TTFT p99 floor {floor['mean']:.3f} s")
    print(f"{'policy':>20} {'hit':>16} {'min hit':>7} {'imbalance':>14} {'max':>6} {'TTFT p99 s':>14}")
    for name, f in summary["policies"].items():
        hit, imb, p99 = f["hit_rate"], f["load_imbalance"], f["ttft_p99_s"]
        print(f"{name:>20} {hit['mean']:7.4f} ± {hit['se']:.4f} {hit['min']:7.4f} {imb['mean']:6.3f} ± {imb['se']:.3f}"
              f" {imb['max']:6.3f} {p99['mean']:6.3f} ± {p99['se']:.3f}")
    for name, figures in summary["per_seed"].items():
        if AS_SENT in figures:
            gaps = [hit - bound for hit, bound in zip(figures["hit_rate"], figures[AS_SENT])]
            gap = Spread.of(gaps)
            print(f"{name:>20} less the one-cache LRU bound in the order it was sent "
                  f"({Spread.of(figures[AS_SENT]).mean:.4f}): hit {gap.mean:+.4f} ± {gap.se:.4f}, min {gap.min:+.4f}")
    for title, pairs in (("less " + str(summary.get("paired_with")), summary["paired"]),
                         ("less the earlier sweep", summary.get("paired_against", {}))):
        for name, f in pairs.items():
            hit, imb, p99 = f["hit_rate"], f["load_imbalance"], f["ttft_p99_s"]
            print(f"{name:>20} {title}: hit {hit['mean']:+.4f} ± {hit['se']:.4f}, imbalance {imb['mean']:+.3f}"
                  f" ± {imb['se']:.3f}, TTFT p99 {p99['mean']:+.3f} ± {p99['se']:.3f} s")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("python -m router.seed_sweep", __doc__.split("\n\n")[0])
    parser.add_argument("--workload-seeds", type=int, required=True, help="replay seeds --seed .. --seed + N - 1")
    parser.add_argument("--jobs", type=int, default=1, help="seeds replayed at once (processes)")
    parser.add_argument("--against", help="an earlier sweep's JSON: pair this sweep's runs with its, seed by seed")
    args = parser.parse_args(argv)
    try:
        workload_kind(args)
        if args.seeds != 1:
            raise ValueError("--seeds varies only the baselines' seeds; give --workload-seeds alone")
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        earlier = json.load(open(args.against)) if args.against else None
        summary = sweep(args, args.workload_seeds, args.jobs)
        if earlier is not None:
            summary["paired_against"] = pair_against(summary, earlier)
    except ValueError as error:
        parser.error(str(error))
    with open(args.json, "w") as handle:
        json.dump(summary, handle, indent=2)
    print_sweep(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
