"""The engine's step times as the live run measured them, for the replay's
step profile: the slowdown of the shared machine (:func:`measured_slowdown`,
:func:`slowed`), the step model the live Workers fitted to their own steps
(:func:`workers_profile`), and steps varied by the live inter-token gaps
(:class:`VariableSteps`, :func:`step_factors`)."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, replace

from router.batching import StepProfile


def measured_slowdown(report: dict, profile: StepProfile) -> float:
    """Live mean inter-token latency / the profile's mean step for the steps the live engines ran."""
    itl_sum = itl_count = steps = prefill = decode = 0
    for result in report["results"].values():
        for round_ in result.get("rounds", []):
            if round_["itl_s"]["mean"] is None:
                continue
            num_itl = round_["output_tokens_per_s"] * round_["wall_s"] - round_["num_ok"]  # gaps: tokens - 1 each
            itl_sum += round_["itl_s"]["mean"] * num_itl
            itl_count += num_itl
            for replica in round_["server_stats"].get("replicas", {}).values():
                steps += replica["num_steps"]
                prefill += replica["prefill_tokens"]
                decode += replica["decode_tokens"]
    if not steps or not itl_count:
        raise ValueError("the live run has no inter-token latencies or engine step counts; give --engine-slowdown")
    profile_step_s = (steps * profile.base_s + prefill * profile.prefill_token_s
                      + decode * profile.decode_seq_s) / steps
    return (itl_sum / itl_count) / profile_step_s


@dataclass(frozen=True)
class VariableSteps(StepProfile):
    """A profile whose prefill and mixed steps (the ones a request's first
    token comes from) each take a factor drawn from ``factors`` (mean 1) times
    the profile's time; decode-only runs, taken in closed form, keep the mean.
    The factors are the live run's inter-token gaps over their mean: how
    unevenly the shared machine lets an engine step (a stall of another
    process lands on whichever step runs then)."""

    factors: tuple[float, ...] = (1.0,)
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.factors or min(self.factors) < 0:
            raise ValueError("factors must be a non-empty tuple of numbers >= 0")
        object.__setattr__(self, "_draws", random.Random(self.seed))

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int) -> float:
        return super().step_s(num_prefill_tokens, num_decode_seqs, num_context_tokens) * self._draws.choice(self.factors)


def workers_profile(report: dict, profile: StepProfile) -> StepProfile:
    """``profile`` with the step model the live Workers fitted to their own
    steps in the run (``worker.step_costs``; medians over every arm's rounds
    and Workers of what ``/stats`` reports: ``prefill_s_per_token`` = the
    per-token term, ``queue_token_cost`` x it = the per-sequence term,
    ``decode_token_cost - queue_token_cost`` x it = the base), keeping its
    context term and limits. Measured from the engines' step timings under
    the run's own contention, not from the compared TTFTs; ValueError when no
    Worker reported both prices (an older load test, too few steps)."""
    rows = [stats for result in report["results"].values() for round_ in result.get("rounds", ())
            for stats in round_.get("server_stats", {}).get("replicas", {}).values()
            if stats.get("decode_token_cost", 0.0) > 0 and (stats.get("prefill_s_per_token") or 0.0) > 0]
    if not rows:
        raise ValueError("the live run's Workers reported no fitted step prices; use --engine-slowdown")
    per_token = statistics.median(r["prefill_s_per_token"] for r in rows)
    busy = statistics.median(r["decode_token_cost"] for r in rows)
    queue = statistics.median(r.get("queue_token_cost", 0.0) for r in rows)
    return replace(profile, base_s=max(busy - queue, 0.0) * per_token, prefill_token_s=per_token,
                   decode_seq_s=queue * per_token, name=f"{profile.name}, the live Workers' own step fit")


def step_factors(report: dict) -> tuple[float, ...]:
    """The live inter-token gaps over their mean, every router pooled (empty: not recorded)."""
    gaps = [x for result in report["results"].values() for x in result.get("itl_samples_s", ())]
    if not gaps:
        return ()
    mean = statistics.fmean(gaps)
    return tuple(x / mean for x in gaps)


def slowed(profile: StepProfile, factor: float) -> StepProfile:
    """``profile`` with every time ``factor`` times longer (limits unchanged)."""
    if not factor > 0:
        raise ValueError(f"slowdown must be > 0, got {factor!r}")
    return replace(profile, base_s=profile.base_s * factor, prefill_token_s=profile.prefill_token_s * factor,
                   decode_seq_s=profile.decode_seq_s * factor, context_token_s=profile.context_token_s * factor,
                   name=f"{profile.name} x{factor:.2f}")
