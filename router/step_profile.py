"""One engine step's time and limits (:class:`StepProfile`), the profile a
continuous-batching replica (:mod:`router.batching`) steps by; and the
GPU-like profile of issue 14 (:data:`H100_LLAMA_8B`)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class StepProfile:
    """One engine step's time, ``step_s = base_s + prefill_token_s × prefill
    tokens + decode_seq_s × decoding sequences + context_token_s × context
    tokens`` (the KV positions the step's sequences attend to), and the
    engine's limits: ``max_batch_tokens`` (decodes + prefill chunks per step)
    and ``kv_capacity_tokens`` (KV positions the running sequences may hold).
    ``name`` and ``source`` say where the figures come from."""

    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    max_batch_tokens: int
    kv_capacity_tokens: int
    name: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("base_s", "prefill_token_s", "decode_seq_s", "context_token_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.base_s + self.prefill_token_s > 0:
            raise ValueError("a step must take time: base_s + prefill_token_s > 0")
        for name in ("max_batch_tokens", "kv_capacity_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        data = json.loads(Path(path).read_text())
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**fields)

    def to_dict(self) -> dict:
        return asdict(self)

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int) -> float:
        return (self.base_s + self.prefill_token_s * num_prefill_tokens + self.decode_seq_s * num_decode_seqs
                + self.context_token_s * num_context_tokens)

    def prefill_s(self, num_computed_tokens: int, num_cached_tokens: int = 0) -> float:
        """Time to first token of one request alone on an idle replica (chunked prefill)."""
        total, done, elapsed = num_cached_tokens + num_computed_tokens, num_cached_tokens, 0.0
        while True:
            chunk = min(self.max_batch_tokens, total - done)
            done += chunk
            elapsed += self.step_s(chunk, 0, done)
            if done >= total:
                return elapsed

    def service_s(self, num_computed_tokens: int, num_output_tokens: int) -> float:
        """Busy time of one request alone: its prefill, then its decode steps."""
        elapsed = self.prefill_s(num_computed_tokens)
        num_decode_steps = max(num_output_tokens - 1, 0)
        context = num_computed_tokens * num_decode_steps + num_decode_steps * (num_decode_steps + 1) // 2
        return elapsed + num_decode_steps * (self.base_s + self.decode_seq_s) + self.context_token_s * context

    @property
    def decode_token_cost(self) -> float:
        """Prefill-token equivalents of one output token on an otherwise idle
        replica (a step of its own: base + one decode + a 4k context), for the
        router's work estimate. Batched decodes share the base, so under load
        this overstates a token's cost; what it prices is how long a decode
        keeps a replica busy, which is what load balance is measured in."""
        return (self.base_s + self.decode_seq_s + 4096 * self.context_token_s) / max(self.prefill_token_s, 1e-12)


    @property
    def queue_token_cost(self) -> float:
        """Prefill-token equivalents of the delay one decoding sequence adds to
        a queued request's time to first token per output token: its row and
        its 4k-token context in each step, not the step's base (the queued
        prefill runs in the same steps)."""
        return (self.decode_seq_s + 4096 * self.context_token_s) / max(self.prefill_token_s, 1e-12)


# Llama-3.1-8B (bf16) on one H100 SXM, vLLM-like chunked prefill: ~4 ms fixed per step
# (kernel launches, sampling, scheduling), ~50 µs per prefill token (~20k prefill tokens/s,
# near the published 15-25k tok/s prefill throughput of 8B models on H100), ~20 µs per decode
# sequence (its weights-bound GEMM rows and sampling), ~40 ns per context token read
# (16 GiB/s-equivalent of KV reads: 128 kB of KV per token at 3.35 TB/s HBM ≈ 38 ns);
# 8,192-token steps (vLLM's default max_num_batched_tokens for chunked prefill on H100);
# ~500k KV tokens (80 GB − 16 GB of weights / 128 kB per token). Figures from issue 14,
# the H100 SXM datasheet (3.35 TB/s) and the Llama-3.1-8B config (32 layers, 8 KV heads × 128).
H100_LLAMA_8B = StepProfile(
    base_s=0.004, prefill_token_s=50e-6, decode_seq_s=20e-6, context_token_s=40e-9,
    max_batch_tokens=8192, kv_capacity_tokens=500_000, name="llama-3.1-8b-h100",
    source="issue 14 step profile; H100 SXM 3.35 TB/s; Llama-3.1-8B 32 layers x 8 KV heads x 128 dims bf16",
)
