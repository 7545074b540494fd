"""The worker engine's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cache.segmented_lru import SERVING_PROTECTED_SHARE
from worker.model import TinyLlamaSpec

_DTYPES = ("float32", "bfloat16", "float16")
_GEMMS = ("auto", "packed", "plain")
_ATTENTION_KERNELS = ("auto", "torch", "native", "flashinfer")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an :class:`worker.Engine` needs; composed at the edge (deploy/).

    Memory: the KV pool holds ``kv_pool_tokens`` positions (``None``: sized
    from free GPU memory on CUDA, else ``cache_budget_tokens + 8 *
    max_model_len``); the radix cache keeps at most ``cache_budget_tokens`` of
    them for reuse, the rest serves running requests. The pool must be larger
    than the budget so that cached prefixes never starve running requests.
    """

    model: str = "tiny-llama"  # "tiny-llama" (built in, seeded) or an HF path / hub id
    tiny_llama: TinyLlamaSpec = field(default_factory=TinyLlamaSpec)  # used iff model == "tiny-llama"
    cache_budget_tokens: int = 32768  # unique positions the radix cache may hold
    max_cache_namespaces: int = 1024  # live cache_salt namespaces; at the cap the LRU unlocked one is evicted
    # eviction: adaptive segmented LRU (cache/segmented_lru.py): prefixes a request reused are evicted only
    # after every entry cached once, within a protected share of cache_budget_tokens that starts here and
    # adapts to what the cache misses; 0: plain LRU
    cache_protected_share: float = SERVING_PROTECTED_SHARE
    kv_pool_tokens: int | None = None  # KV pool capacity in positions (rounded up to blocks)
    gpu_memory_fraction: float = 0.85  # CUDA with kv_pool_tokens=None: share of free memory for the pool
    block_size: int = 16  # positions per KV block (pool and radix tree)
    deterministic: bool = False  # batch-invariant numerics: outputs == worker.reference.generate
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "float32"  # one of float32, bfloat16, float16
    max_batch_tokens: int = 1024  # tokens per forward step (decodes + prefill chunks)
    max_num_seqs: int = 64  # running requests at once
    max_queued_requests: int = 1024  # waiting requests before EngineOverloaded
    max_model_len: int | None = None  # prompt + output limit; None: the model's context length
    seed: int = 0  # engine RNG: seeds sampling for requests that carry no seed
    num_threads: int | None = None  # torch intra-op threads (process-wide); None: leave torch's choice
    tune_malloc: bool = True  # raise glibc malloc thresholds (process-wide; see worker/host.py)
    trust_remote_code: bool = False
    attention_scratch_tokens: int = 32768  # K/V positions attention gathers at once (its scratch bound)
    gemm: str = "auto"  # linear kernel: "auto" (pre-packed oneDNN where it exists and checks out), "packed", "plain"
    # default mode's attention: "auto" (FlashInfer on CUDA where it imports; on CPU float32 the native
    # decode kernel of worker/native/ where it builds and checks out; else torch), "torch", "native", "flashinfer"
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if isinstance(self.tiny_llama, Mapping):  # from YAML: {"hidden_size": 256, ...}
            object.__setattr__(self, "tiny_llama", TinyLlamaSpec(**self.tiny_llama))
        if not isinstance(self.tiny_llama, TinyLlamaSpec):
            raise ValueError(f"tiny_llama must be a TinyLlamaSpec, got {self.tiny_llama!r}")
        _check_int("cache_budget_tokens", self.cache_budget_tokens, minimum=0)
        _check_int("max_cache_namespaces", self.max_cache_namespaces, minimum=1)
        if (isinstance(self.cache_protected_share, bool) or not isinstance(self.cache_protected_share, (int, float))
                or not 0.0 <= self.cache_protected_share <= 1.0):
            raise ValueError(f"cache_protected_share must be a number within [0, 1], got {self.cache_protected_share!r}")
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("max_batch_tokens", self.max_batch_tokens, minimum=1)
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("max_queued_requests", self.max_queued_requests, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        _check_int("attention_scratch_tokens", self.attention_scratch_tokens, minimum=1)
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, minimum=1)
        if self.kv_pool_tokens is not None:
            _check_int("kv_pool_tokens", self.kv_pool_tokens, minimum=1)
            if self.kv_pool_tokens <= self.cache_budget_tokens:
                raise ValueError(
                    f"kv_pool_tokens {self.kv_pool_tokens} must exceed cache_budget_tokens"
                    f" {self.cache_budget_tokens}: the pool also holds running requests"
                )
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=2)
        if self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_batch_tokens {self.max_batch_tokens} < max_num_seqs {self.max_num_seqs}:"
                " every running request must fit one token per step"
            )
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}")
        if self.gemm not in _GEMMS:
            raise ValueError(f"gemm must be one of {_GEMMS}, got {self.gemm!r}")
        if self.gemm == "packed" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError("gemm 'packed' needs device 'cpu' and dtype 'float32'")
        if self.attention_kernel not in _ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {_ATTENTION_KERNELS}, got {self.attention_kernel!r}")
        if self.attention_kernel == "native" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError("attention_kernel 'native' needs device 'cpu' and dtype 'float32'")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be a bool, got {self.deterministic!r}")
        if self.deterministic and 64 % self.block_size and self.block_size % 64:
            raise ValueError(
                f"deterministic mode needs a block_size that divides 64 or is a multiple of 64, got {self.block_size}"
            )


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """How a Worker fetches a cached prefix from the replica holding it
    (issue 13; worker/kv_fetch.py); composed at the edge (deploy/settings.py).

    ``enabled``: follow the router's fetch hints and serve other replicas'
    exports. ``timeout_s``: the longest a request waits for an owner's bundle
    before it recomputes (an owner that evicted the prefix or died answers at
    once; a slow or hung one costs this much). ``probe_bytes``: the size of
    the object-store round trip timed at start, the bandwidth estimate until
    real fetches refine it. ``min_speedup``: fetch only when recomputing is
    estimated to take more than this many times the transfer (1: whenever
    the transfer is faster; above 1, a margin for the estimates' error; 0:
    every hinted fetch, whatever the estimates, e.g. to test the mechanics).
    ``prior_overhead_s``: a fetch's fixed cost (the call to the owner, its
    copy and checksum, the import) assumed until one completes and measures
    it. At 0 every replica's first fetch went ahead however few tokens it
    moved: in the live multi-turn load test each round's first hint fetched
    64 tokens that recompute in ~2 ms, took ~0.2 s (the call to a busy owner
    on this 2-core VM; ``harness.fetch_bench``: 0.02-0.2 s), and was the
    run's TTFT p99. 0.05 s keeps a few blocks local; a prefix that takes
    longer than that to recompute is still fetched, and the first completed
    fetch replaces the prior with what it measured.
    ``patience``: a request waits for its fetch at most this many times its
    own estimated recompute time, then recomputes; the fetch runs on (up to
    ``timeout_s``), is measured and lands for later requests. 1: a wrong
    estimate costs a request at most its recompute time again (live, on this
    2-core VM, a fresh replica's first fetch of 512 tokens took ~0.3 s, ~3x
    recomputing them, and such fetches were a shared-prefix run's TTFT p99).
    0: wait up to ``timeout_s`` (as with ``min_speedup`` 0, or before the
    replica has timed a prefill step).
    ``prefill_patience``: the same for a hint whose owner, by the router's
    bookings, still computes the prefix (``FetchHint.owner_computing``):
    the owner's export waits for that prefill (``ExportRequest.wait_s``),
    and a wait that ends in a fetch keeps the prefix computed once in the
    fleet. 3: simulated shared-prefix FIFO (40 seeds) kept the one-cache
    hit rate in every seed, where 1 lost a group's prefix in two
    (BENCHMARKS.md, "A fetch waits for the owner's prefill in flight").
    """

    enabled: bool = True
    timeout_s: float = 2.0
    probe_bytes: int = 4 << 20
    min_speedup: float = 1.0
    prior_overhead_s: float = 0.05
    patience: float = 1.0
    prefill_patience: float = 3.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"fetch enabled must be a bool, got {self.enabled!r}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
            raise ValueError(f"fetch timeout_s must be a number in (0, 600], got {timeout!r}")
        _check_int("probe_bytes", self.probe_bytes, minimum=1)
        for name, high in (("min_speedup", 1000), ("prior_overhead_s", 60), ("patience", 1000),
                           ("prefill_patience", 1000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
                raise ValueError(f"fetch {name} must be a number in [0, {high}], got {value!r}")
