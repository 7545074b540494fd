"""What a radix cache holds, as the router sees it: chained block hashes.

A worker reports the hashes of every full block its tree caches (at the
router's block size, per salt), so the router can tell which replica holds a
prompt's prefix with the same :func:`cache.block_hashes` it computes itself.
:class:`CacheSummary` is the record a worker sends (hashes plus load). The
walk that finds the hashes is :func:`cached_block_hashes`
(cache/cached_hashes.py), their byte form :func:`pack_block_hashes`
(cache/packed_hashes.py); both are importable from here, where they began.
"""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass

from cache.cached_hashes import cached_block_hashes
from cache.output_quantiles import check_output_quantiles, quantiles_from_wire
from cache.packed_hashes import pack_array, unpack_base64
from cache.packed_hashes import pack_block_hashes, unpack_block_hashes  # noqa: F401 - re-exported: defined here first
from cache.radix import RadixCache


# --------------------------------------------------------------------------
# The replica summary record: what a worker reports through Ray Serve's
# routing stats and the router consumes. It lives here (not in router/) because
# workers may not import the router: deploy → worker → cache, deploy → router → cache.

SUMMARY_FORMAT = "kvroute.cache_summary.v1"  # long keys, every field (still read)
COMPACT_FORMAT = "kvroute.cs.v2"  # what :meth:`CacheSummary.to_dict` writes: short keys, zeros left out
# v2's short key for each field; "format", "replica_id", "version" and "epoch" keep their names
# (a router reads version and epoch before parsing, to skip what it has seen)
_COMPACT_KEYS = {
    "timestamp_s": "t", "block_size": "bs", "num_cached_tokens": "c", "budget_tokens": "b",
    "num_queued_tokens": "q", "num_running_tokens": "r", "num_running": "nr", "num_waiting": "nw",
    "num_prefill_tokens_total": "pt", "num_output_tokens_total": "ot", "mean_output_tokens": "mo",
    "decode_token_cost": "dc", "queue_token_cost": "qc", "base_version": "bv",
    "fetch_token_cost": "fc", "fetch_overhead_tokens": "fo", "busy_s_total": "bu",
    "num_prefilling_tokens": "pf",
}
_COUNT_FIELDS = (
    "num_cached_tokens",
    "budget_tokens",
    "num_queued_tokens",
    "num_running_tokens",
    "num_running",
    "num_waiting",
    "num_prefill_tokens_total",
    "num_output_tokens_total",
    "num_prefilling_tokens",
)

_RATE_FIELDS = ("mean_output_tokens", "decode_token_cost", "queue_token_cost", "fetch_token_cost",
                "fetch_overhead_tokens", "busy_s_total")  # floats >= 0, absent reads as 0.0


def rounded_rate(value: float, digits: int = 3) -> float:
    """``value`` to ``digits`` significant digits: what a replica puts in a
    rate field it reports every period (a fetch cost), so the wire carries
    ~5 characters, not 18, of a figure the router takes a median of."""
    return float(f"{value:.{digits}g}")


@dataclass(frozen=True, slots=True)
class CacheSummary:
    """One replica's cache contents and load at one moment, as the router sees it.

    Fields:
      replica_id: the replica that took it (Ray Serve's full replica id string).
      version: strictly increasing per replica (a counter); a router keeps the
        newest it has seen and ignores older or equal ones.
      timestamp_s: the replica's clock when taken (informational only; routers
        never compare clocks across machines).
      block_size: the router block size the hashes are chained at
        (``cache.block_hashes(tokens, block_size, salt)`` of every cached path).
      block_hashes: every full block the radix tree caches, all salts.
      num_cached_tokens / budget_tokens: the tree's size and its budget.
      num_queued_tokens: prompt tokens of waiting requests not yet prefilled.
      num_running_tokens: tokens of the running sequences (their KV footprint).
      num_running / num_waiting: request counts.
      mean_output_tokens: mean output length (tokens) of the requests this
        replica finished recently (a small rolling window); 0.0 when none. The
        router's estimate of decode work, in place of ``max_tokens``.
      decode_token_cost / queue_token_cost: what one output token costs this
        replica's engine, in prefill-token equivalents, as it measured its
        own steps (``worker.step_costs.StepCosts``): the busy time of a lone
        decode step (its fixed cost plus one sequence's row), and the delay
        one decoding sequence adds to every step it shares (its row only);
        0.0 while not measured. The router prices expected output with them
        (``PolicyConfig.learn_token_costs``) instead of a configured guess.
      fetch_token_cost / fetch_overhead_tokens: what fetching a cached
        prefix from another replica costs this one, in prefill-token
        equivalents, as its fetcher estimates it from measured bandwidth,
        fixed cost and prefill rate (``worker.kv_fetch.PrefixFetcher``): a
        fetch of ``n`` tokens costs ``n * fetch_token_cost +
        fetch_overhead_tokens``, against ``n`` to recompute them (scaled by
        the worker's required speed-up); 0.0 while not measured. The router
        offers a hot prefix a fetched holder only where fetching pays
        (``PolicyConfig.replicate_hot_prefixes``).
      num_prefill_tokens_total / num_output_tokens_total: tokens this replica
        process has run through prefill and generated since it started (its
        epoch): counters every router reads alike, so routers that see only
        their own decisions still agree on each replica's share of the work.
      busy_s_total: seconds this replica's engine spent in steps since it
        started (its epoch), to the millisecond: a counter every router reads
        alike, where each router's own view of who is busy covers only its
        own requests (``router.reported_busy.ReportedBusy``).
      num_prefilling_tokens: prompt tokens its running requests' prefill
        has still to compute (a chunked prefill in progress; a FIFO
        server's request in prefill): work ``num_queued_tokens`` (waiting
        prompts) no longer counts once a request is admitted. A router that
        shares the traffic with others reads it, for their requests' long
        prefills it did not book (``PolicyConfig.peer_prefill_from_reports``).
      output_quantiles: its recently finished requests' output lengths at
        evenly spaced probabilities (``cache.output_quantiles``; ``()`` for
        none; at most 256 non-decreasing ints): the tail of its outputs, for
        how long a request already decoding has left (``router.work_left``).
      epoch: names the replica process's stream of summaries ("" for none); a
        new epoch (a restart) starts its versions afresh and drops what the
        router held for the replica.
      base_version / removed_hashes: 0 (or ``version``) for a full
        snapshot. Otherwise a *delta*: ``block_hashes`` holds the blocks added
        and ``removed_hashes`` those dropped since the state this replica
        reported at ``base_version`` (same epoch). A router applies it only if
        it holds that state, else it knows it missed something and waits for
        the next snapshot. :class:`SummaryStream` makes them.

    ``load_tokens = num_queued_tokens + num_running_tokens`` is the load term
    the router compares.

    Wire format (:meth:`to_dict`, a plain JSON-able dict for Ray Serve's
    ``record_routing_stats``), compact (v2)::

        {"format": "kvroute.cs.v2", "replica_id": str, "version": int,
         "epoch"?: str, "t": timestamp_s, "bs": block_size,
         "h"?: base64 of the sorted block hashes as little-endian uint64,
         "rm"?: the same of removed_hashes (a delta),
         "c"?, "b"?, "q"?, "r"?, "nr"?, "nw"?, "pt"?, "ot"?, "pf"?: the counts,
         "mo"?: mean_output_tokens, "dc"?, "qc"?: the token costs,
         "fc"?, "fo"?: the fetch costs, "bu"?: busy_s_total,
         "oq"?: output_quantiles as a list, "bv"?: base_version}

    where a field left out is 0 (empty for hashes, "" for the epoch): a
    summary's fixed cost is what changes, not ~350 bytes of names and zeros
    (at 64 replicas of a trace that fills caches only partly, that was most
    of a delta).

    A delta of a stream sent by reference also carries ``"bref"``
    (:data:`BASE_REF_KEY`): an opaque handle, put there by the worker's
    adapter (a Ray ``ObjectRef``), to :func:`pack_block_hashes` of the
    state at ``bv``; :meth:`from_dict` ignores it, the router's adapter
    fetches it when it does not hold that state.

    :meth:`from_dict` also reads v1 (``to_dict(compact=False)``)::

        {"format": "kvroute.cache_summary.v1", "replica_id": str,
         "version": int, "timestamp_s": float, "block_size": int,
         "num_blocks": int,
         "block_hashes": base64 of the sorted hashes as little-endian uint64,
         "num_cached_tokens": int, "budget_tokens": int,
         "num_queued_tokens": int, "num_running_tokens": int,
         "num_running": int, "num_waiting": int,
         "mean_output_tokens": float,  # absent reads as 0.0
         "decode_token_cost": float, "queue_token_cost": float,
         "fetch_token_cost": float, "fetch_overhead_tokens": float,
         "busy_s_total": float,  # the same
         "output_quantiles": [int, ...]}  # absent reads as ()

    Size: ~10.7 bytes per cached block (a 1M-token tree at block size 64 is
    ~170 kB). :meth:`from_dict` raises ``ValueError`` naming the bad field;
    ``from_dict(to_dict(s)) == s`` in both formats, but for v2's
    ``timestamp_s``, rounded to the millisecond (routers never compare it).
    """

    replica_id: str
    version: int
    timestamp_s: float
    block_size: int
    block_hashes: frozenset[int]
    num_cached_tokens: int = 0
    budget_tokens: int = 0
    num_queued_tokens: int = 0
    num_running_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    mean_output_tokens: float = 0.0
    num_prefill_tokens_total: int = 0
    num_output_tokens_total: int = 0
    epoch: str = ""
    base_version: int = 0
    removed_hashes: frozenset[int] = frozenset()
    decode_token_cost: float = 0.0
    queue_token_cost: float = 0.0
    fetch_token_cost: float = 0.0
    fetch_overhead_tokens: float = 0.0
    busy_s_total: float = 0.0
    num_prefilling_tokens: int = 0
    output_quantiles: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.replica_id, str) or not self.replica_id:
            raise ValueError(f"replica_id must be a non-empty str, got {self.replica_id!r}")
        _check_count("version", self.version)
        if type(self.block_size) is not int or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.timestamp_s, (int, float)) or isinstance(self.timestamp_s, bool) \
                or not math.isfinite(self.timestamp_s):
            raise ValueError(f"timestamp_s must be a finite number, got {self.timestamp_s!r}")
        if not isinstance(self.block_hashes, frozenset):
            raise ValueError(f"block_hashes must be a frozenset, got {type(self.block_hashes).__name__}")
        for name in _COUNT_FIELDS:
            _check_count(name, getattr(self, name))
        for name in _RATE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.epoch, str):
            raise ValueError(f"epoch must be a str, got {self.epoch!r}")
        _check_count("base_version", self.base_version)
        if self.base_version > self.version:
            raise ValueError(f"base_version {self.base_version} is after version {self.version}")
        if not isinstance(self.removed_hashes, frozenset):
            raise ValueError(f"removed_hashes must be a frozenset, got {type(self.removed_hashes).__name__}")
        if self.removed_hashes and not self.is_delta:
            raise ValueError("a full snapshot has no removed_hashes")
        check_output_quantiles(self.output_quantiles)

    @property
    def is_delta(self) -> bool:
        return self.base_version not in (0, self.version)

    @property
    def load_tokens(self) -> int:
        return self.num_queued_tokens + self.num_running_tokens

    @classmethod
    def from_radix(
        cls,
        radix: RadixCache,
        block_size: int,
        *,
        replica_id: str,
        version: int,
        timestamp_s: float,
        num_queued_tokens: int = 0,
        num_running_tokens: int = 0,
        num_running: int = 0,
        num_waiting: int = 0,
        mean_output_tokens: float = 0.0,
        num_prefill_tokens_total: int = 0,
        num_output_tokens_total: int = 0,
        decode_token_cost: float = 0.0,
        queue_token_cost: float = 0.0,
        fetch_token_cost: float = 0.0,
        fetch_overhead_tokens: float = 0.0,
        busy_s_total: float = 0.0,
        num_prefilling_tokens: int = 0,
        output_quantiles: tuple[int, ...] = (),
    ) -> CacheSummary:
        """Summarise ``radix`` (cost of :func:`cached_block_hashes`) plus the given load."""
        return cls(
            replica_id=replica_id,
            version=version,
            timestamp_s=float(timestamp_s),
            block_size=block_size,
            block_hashes=frozenset(cached_block_hashes(radix, block_size)),
            num_cached_tokens=radix.num_tokens,
            budget_tokens=radix.budget_tokens,
            num_queued_tokens=num_queued_tokens,
            num_running_tokens=num_running_tokens,
            num_running=num_running,
            num_waiting=num_waiting,
            mean_output_tokens=float(mean_output_tokens),
            num_prefill_tokens_total=num_prefill_tokens_total,
            num_output_tokens_total=num_output_tokens_total,
            decode_token_cost=float(decode_token_cost),
            queue_token_cost=float(queue_token_cost),
            fetch_token_cost=float(fetch_token_cost),
            fetch_overhead_tokens=float(fetch_overhead_tokens),
            busy_s_total=float(busy_s_total),
            num_prefilling_tokens=num_prefilling_tokens,
            output_quantiles=output_quantiles,
        )

    def to_dict(self, compact: bool = True) -> dict:
        if compact:
            return self._to_compact()
        packed = pack_array(self.block_hashes)
        out = {
            "format": SUMMARY_FORMAT,
            "replica_id": self.replica_id,
            "version": self.version,
            "timestamp_s": float(self.timestamp_s),
            "block_size": self.block_size,
            "num_blocks": len(packed),
            "block_hashes": base64.b64encode(packed.tobytes()).decode("ascii"),
        }
        for name in _COUNT_FIELDS:
            out[name] = getattr(self, name)
        for name in _RATE_FIELDS:
            if name == "mean_output_tokens" or getattr(self, name):
                out[name] = float(getattr(self, name))
        if self.epoch:
            out["epoch"] = self.epoch
        if self.output_quantiles:
            out["output_quantiles"] = list(self.output_quantiles)
        if self.is_delta:
            removed = pack_array(self.removed_hashes)
            out.update(base_version=self.base_version, num_removed=len(removed),
                       removed_hashes=base64.b64encode(removed.tobytes()).decode("ascii"))
        return out

    def _to_compact(self) -> dict:
        out = {"format": COMPACT_FORMAT, "replica_id": self.replica_id, "version": self.version}
        if self.epoch:
            out["epoch"] = self.epoch
        out["t"] = round(float(self.timestamp_s), 3)  # informational only: the millisecond is enough
        out["bs"] = self.block_size
        if self.block_hashes:
            out["h"] = base64.b64encode(pack_array(self.block_hashes).tobytes()).decode("ascii")
        if self.removed_hashes:
            out["rm"] = base64.b64encode(pack_array(self.removed_hashes).tobytes()).decode("ascii")
        for name in _COUNT_FIELDS:
            if getattr(self, name):
                out[_COMPACT_KEYS[name]] = getattr(self, name)
        for name in _RATE_FIELDS:
            if getattr(self, name):
                out[_COMPACT_KEYS[name]] = float(getattr(self, name))
        if self.output_quantiles:
            out["oq"] = list(self.output_quantiles)
        if self.base_version:
            out["bv"] = self.base_version
        return out

    @classmethod
    def _from_compact(cls, data: Mapping) -> CacheSummary:
        missing = [k for k in ("replica_id", "version", "t", "bs") if k not in data]
        if missing:
            raise ValueError(f"cache summary misses {', '.join(missing)}")
        return cls(
            replica_id=data["replica_id"],
            version=data["version"],
            timestamp_s=_number(data["t"], "timestamp_s"),
            block_size=data["bs"],
            block_hashes=frozenset(unpack_base64(data.get("h", ""), "block_hashes")),
            **{name: data.get(_COMPACT_KEYS[name], 0) for name in _COUNT_FIELDS},
            **{name: _number(data.get(_COMPACT_KEYS[name], 0.0), name) for name in _RATE_FIELDS},
            epoch=data.get("epoch", ""),
            output_quantiles=quantiles_from_wire(data.get("oq", ())),
            base_version=data.get("bv", 0),
            removed_hashes=frozenset(unpack_base64(data.get("rm", ""), "removed_hashes")),
        )

    @classmethod
    def from_dict(cls, data: object) -> CacheSummary:
        """Parse :meth:`to_dict` output (either format); ``ValueError`` names what is malformed."""
        if not isinstance(data, Mapping):
            raise ValueError(f"cache summary must be a dict, got {type(data).__name__}")
        if data.get("format") == COMPACT_FORMAT:
            return cls._from_compact(data)
        if data.get("format") != SUMMARY_FORMAT:
            raise ValueError(f"cache summary format must be {COMPACT_FORMAT!r} or {SUMMARY_FORMAT!r}, "
                             f"got {data.get('format')!r}")
        missing = [k for k in ("replica_id", "version", "timestamp_s", "block_size", "num_blocks", "block_hashes")
                   if k not in data]
        if missing:
            raise ValueError(f"cache summary misses {', '.join(missing)}")
        hashes = _unpack(data, "block_hashes", "num_blocks")
        removed = _unpack(data, "removed_hashes", "num_removed") if "removed_hashes" in data else ()
        return cls(
            replica_id=data["replica_id"],
            version=data["version"],
            timestamp_s=_number(data["timestamp_s"], "timestamp_s"),
            block_size=data["block_size"],
            block_hashes=frozenset(hashes),
            **{name: data.get(name, 0) for name in _COUNT_FIELDS},
            **{name: _number(data.get(name, 0.0), name) for name in _RATE_FIELDS},
            epoch=data.get("epoch", ""),
            output_quantiles=quantiles_from_wire(data.get("output_quantiles", ())),
            base_version=data.get("base_version", 0),
            removed_hashes=frozenset(removed),
        )


BASE_REF_KEY = "bref"  # a delta's out-of-band handle to its base (``SummaryStream(by_reference=True)``)


def _number(value: object, name: str) -> float:
    """``value`` as a float; ``ValueError`` unless it is an int or float (never a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _unpack(data: Mapping, key: str, count_key: str) -> array:
    """v1: hashes plus their stated count."""
    if count_key not in data:
        raise ValueError(f"cache summary misses {count_key}")
    count = data[count_key]
    _check_count(count_key, count)
    try:
        hashes = unpack_base64(data[key], key)
    except ValueError as error:
        if "multiple of 8" not in str(error):
            raise
        hashes = None
    if hashes is None or len(hashes) != count:
        raise ValueError(f"{key} does not hold 8 x {count_key} = {8 * count} bytes")
    return hashes


def _check_count(name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


from cache.summary_stream import SummaryStream  # noqa: E402 - re-exported: the stream was defined here first
