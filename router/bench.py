"""Router decision cost: ``rank`` + ``on_routed`` per request, for 4k-token prompts.

    python -m router.bench [--replicas 8,16,32,64] [--prompt-tokens 4096] [--policy-args JSON]
                           [--fifo-full | --fifo-room] [--cold] [--repeats 3] [--json OUT]

Per fleet size: a policy is warmed up with ``--warmup`` requests (prompts of
``--prompt-tokens`` tokens: a 2k-token prefix shared by one of 64 groups +
a unique rest, or with ``--cold`` all unique; hashed at ``--block-tokens``,
default the policy's; token ids attached, so the within-block match runs
too), each replica sends a summary of the blocks routed to it, requests complete in FIFO order with ``4 × N`` in
flight; then ``--requests`` decisions are timed one by one in thread CPU
time (``time.thread_time_ns``; wall-clock percentiles are reported too),
Python's GC left on, as in a serving process. ``--repeats`` runs (default
3, a new policy each) time the same decisions; the p99 of each decision's
fastest run is the code's own tail, without the machine's interruptions.
Also timed: the ingress's ``cache.block_hashes`` of one prompt, and applying
one replica summary. Pure Python, one core.

States: the default (summaries of what each replica holds, nothing else);
``--fifo-full`` (full caches at FIFO replicas: the turnover term);
``--fifo-room`` (FIFO replicas whose caches have room, with work counters
and output quantiles: the running request at what it has left,
``PolicyConfig.fifo_work_left``). Both FIFO states report every
``--summary-every`` decisions, as deltas.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Iterable

from cache import block_hashes
from cache.summary import CacheSummary
from harness.loadstats import percentile
from router.policy import PolicyConfig, PrefixAffinityPolicy
from router.request import RoutingRequest

NUM_GROUPS = 64
ROOM_TOKENS = 1 << 24  # --fifo-room: free budget every cache reports (room for any prompt, twice)
MEAN_OUTPUT_TOKENS = 150  # --fifo-room: the replicas' mean output, and their output counters' growth per completion
OUTPUT_QUANTILES = (3, 7, 12, 19, 28, 40, 55, 69, 90, 115, 150, 200, 270, 380, 560, 900)  # heavy-tailed, as Mooncake's
BUSY_SHARE = 0.9  # --fifo-room: a replica's busy seconds per second


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _requests(num: int, prompt_tokens: int, block_tokens: int, seed: int, cold: bool = False
              ) -> list[RoutingRequest]:
    """Hash once, reuse: group prefixes are hashed once and chains continued.
    ``cold``: no shared prefix, every prompt its own (nothing of it cached)."""
    rng = random.Random(seed)
    shared_tokens = 0 if cold else prompt_tokens // 2
    prefixes = [[rng.randrange(32000) for _ in range(shared_tokens)] for _ in range(NUM_GROUPS)]
    out = []
    for _ in range(num):
        tokens = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(prompt_tokens - shared_tokens)]
        out.append(RoutingRequest(tuple(block_hashes(tokens, block_tokens)), len(tokens), num_output_tokens=128,
                                  token_ids=tuple(tokens)))
    return out


def _epoch(replica_id: str) -> str:
    """The summary stream ``--fifo-full``'s replica sends (its snapshots and deltas)."""
    return f"{replica_id}@bench"


def _report(replica_id: str, version: int, now: float, block_tokens: int, held: Iterable[int],
            fifo_full: bool, written_tokens: int = 0, room: bool = False, num_done: int = 0) -> CacheSummary:
    """A snapshot of what ``replica_id`` holds; with ``fifo_full`` also a full
    cache, one request running and one waiting, and its prefill counter (so
    the turnover term, ``PolicyConfig.turnover_weight``, is in force), in the
    replica's stream (:func:`_epoch`); with ``room`` as well, a cache with
    room and the counters and quantiles of :func:`_fifo_fields`."""
    held = frozenset(held)
    if not fifo_full:
        return CacheSummary(replica_id, version, now, block_tokens, held)
    size = len(held) * block_tokens
    return CacheSummary(replica_id, version, now, block_tokens, held, num_cached_tokens=size,
                        epoch=_epoch(replica_id), base_version=version,
                        **_fifo_fields(size, written_tokens, room, now, num_done))


def _moving_quantiles(now: float) -> tuple[int, ...]:
    """``OUTPUT_QUANTILES`` with the tail point moved by the report's time:
    a Worker's window of recent outputs moves at almost every report, and
    each move updates the router's pool."""
    return (*OUTPUT_QUANTILES[:-1], OUTPUT_QUANTILES[-1] + int(now * 100) % 97)


def _fifo_fields(size: int, written_tokens: int, room: bool, now: float, num_done: int) -> dict:
    """A FIFO replica's report beyond its blocks: one request running and one
    waiting, its prefill counter, a budget of ``size`` (full) or with
    ``ROOM_TOKENS`` free (``room``: then also busy seconds, output tokens
    at ``MEAN_OUTPUT_TOKENS`` per request of this router's it finished,
    ``num_done``, and output quantiles, as a Worker fills them)."""
    fields = {"budget_tokens": size, "num_running": 1, "num_waiting": 1, "num_prefill_tokens_total": written_tokens}
    if room:
        fields.update(budget_tokens=size + ROOM_TOKENS, busy_s_total=BUSY_SHARE * now,
                      num_output_tokens_total=MEAN_OUTPUT_TOKENS * num_done, mean_output_tokens=MEAN_OUTPUT_TOKENS,
                      output_quantiles=_moving_quantiles(now))
    return fields


class _LruCache:
    """A replica's cache in ``--fifo-full`` (``--fifo-room``: ``room``): the
    blocks routed to it, least recently used out first past
    ``capacity_blocks``, and what changed since its last report (a Worker's
    delta: :meth:`delta`)."""

    def __init__(self, replica_id: str, blocks: Iterable[int], capacity_blocks: int, version: int,
                 block_tokens: int, room: bool = False) -> None:
        self.replica_id, self.version, self.block_tokens, self.room = replica_id, version, block_tokens, room
        self.blocks: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)
        self.capacity_blocks = capacity_blocks
        self.written_tokens = len(self.blocks) * block_tokens
        self._added: set[int] = set()
        self._removed: set[int] = set()

    def add(self, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)
                continue
            self.blocks[block_hash] = None
            self.written_tokens += self.block_tokens
            if block_hash in self._removed:
                self._removed.discard(block_hash)
            else:
                self._added.add(block_hash)
        while len(self.blocks) > self.capacity_blocks:
            evicted = self.blocks.popitem(last=False)[0]
            if evicted in self._added:
                self._added.discard(evicted)
            else:
                self._removed.add(evicted)

    def delta(self, now: float, num_done: int = 0) -> CacheSummary:
        """The next summary, a delta against the last (what
        ``cache.summary_sender.SummarySender``'s stream sends each period),
        built from the changes kept since: a Worker's work, not the router's."""
        base, self.version = self.version, self.version + 1
        size = len(self.blocks) * self.block_tokens  # with room, its budget is size + ROOM_TOKENS: it never fills
        summary = CacheSummary(self.replica_id, self.version, now, self.block_tokens, frozenset(self._added),
                               num_cached_tokens=size, epoch=_epoch(self.replica_id), base_version=base,
                               removed_hashes=frozenset(self._removed),
                               **_fifo_fields(size, self.written_tokens, self.room, now, num_done))
        self._added, self._removed = set(), set()
        return summary


def bench_fleet(num_replicas: int, requests: list[RoutingRequest], num_warmup: int, block_tokens: int,
                policy_args: dict | None = None, fifo_full: bool = False, summary_every: int = 100,
                repeats: int = 1, fifo_room: bool = False) -> dict:
    """The figures of ``repeats`` runs of the same decisions, each with a new
    policy: percentiles over all of them, and ``decision_us_p99_fastest``,
    the p99 over decisions of each one's fastest run. A decision's own work
    (a dict that resizes, a collection by Python's GC) recurs in every run;
    what the machine adds (another process, the hypervisor) rarely hits the
    same decision twice, so the fastest run leaves it out. ``fifo_room``:
    the ``--fifo-room`` state (it implies ``fifo_full``'s reports, with room)."""
    runs = [_run_fleet(num_replicas, requests, num_warmup, block_tokens, policy_args, fifo_full or fifo_room,
                       summary_every, fifo_room) for _ in range(repeats)]
    timings_us = [t for run in runs for t in run["timings_us"]]
    wall_us = [t for run in runs for t in run["wall_us"]]
    summary_us = [t for run in runs for t in run["summary_us"]]
    fastest_us = [min(times) for times in zip(*(run["timings_us"] for run in runs))]
    return {
        "num_replicas": num_replicas,
        "repeats": repeats,
        "decision_us_p50": percentile(timings_us, 50),
        "decision_us_p99": percentile(timings_us, 99),
        "decision_us_max": max(timings_us),
        "decision_us_p99_fastest": percentile(fastest_us, 99),
        "wall_us_p50": percentile(wall_us, 50),
        "wall_us_p99": percentile(wall_us, 99),
        "summary_blocks": runs[0]["summary_blocks"],
        "apply_summary_ms": min(run["apply_summary_ms"] for run in runs),
        "periodic_summary_us_p50": percentile(summary_us, 50) if summary_us else None,
        "periodic_summary_us_max": max(summary_us) if summary_us else None,
    }


def _run_fleet(num_replicas: int, requests: list[RoutingRequest], num_warmup: int, block_tokens: int,
               policy_args: dict | None, fifo_full: bool, summary_every: int, room: bool = False) -> dict:
    clock = _Clock()
    policy = PrefixAffinityPolicy(PolicyConfig(**{**(policy_args or {}), "block_size": block_tokens}), clock=clock)
    replica_ids = [f"replica-{i}" for i in range(num_replicas)]
    policy.set_replicas(replica_ids)
    routed: dict[str, set[int]] = {r: set() for r in replica_ids}
    in_flight: deque[tuple[str, str]] = deque()  # (request id, replica), oldest first
    num_done = dict.fromkeys(replica_ids, 0)  # this router's requests each replica finished
    timings_us: list[float] = []  # thread CPU time: what the router spends
    wall_us: list[float] = []  # wall clock: also counts being descheduled on a shared machine
    summary_us: list[float] = []  # --fifo-full: applying one replica's periodic summary
    caches: dict[str, _LruCache] = {}
    reporting_at: dict[int, list[str]] = {}  # --fifo-full: decision within a period -> who reports before it
    for slot, replica_id in enumerate(replica_ids):
        reporting_at.setdefault(slot * summary_every // num_replicas, []).append(replica_id)
    for number, request in enumerate(requests):
        clock.now += 0.01
        if fifo_full and number == num_warmup // 2:  # a first report: the counters' baseline
            for replica_id in replica_ids:
                policy.on_summary(_report(replica_id, 1, clock.now, block_tokens, routed[replica_id], True,
                                          room=room, num_done=num_done[replica_id]))
        if number == num_warmup:  # every replica reports what it holds
            for replica_id in replica_ids:
                held = routed[replica_id]
                policy.on_summary(_report(replica_id, 2, clock.now, block_tokens, held, fifo_full,
                                          len(held) * block_tokens, room, num_done[replica_id]))
                capacity = len(held) + (ROOM_TOKENS // block_tokens if room else 0)  # with room: no eviction
                caches[replica_id] = _LruCache(replica_id, held, capacity, 2, block_tokens, room)
        elif fifo_full and number > num_warmup:  # replica i reports i / N of a period after replica 0
            for replica_id in reporting_at.get((number - num_warmup) % summary_every, ()):
                summary = caches[replica_id].delta(clock.now, num_done[replica_id])
                started_cpu = time.thread_time_ns()
                policy.on_summary(summary)
                summary_us.append((time.thread_time_ns() - started_cpu) / 1000)
        started_cpu, started = time.thread_time_ns(), time.perf_counter_ns()
        chosen = policy.rank(request, request_id=str(number))[0]  # reserves, as the Ray adapter does
        policy.on_routed(request, chosen, str(number))
        elapsed_us = (time.perf_counter_ns() - started) / 1000
        elapsed_cpu_us = (time.thread_time_ns() - started_cpu) / 1000
        if number >= num_warmup:
            timings_us.append(elapsed_cpu_us)
            wall_us.append(elapsed_us)
            if fifo_full:
                caches[chosen].add(request.block_hashes)
        else:
            routed[chosen].update(request.block_hashes)
        in_flight.append((str(number), chosen))
        if len(in_flight) > 4 * num_replicas:
            request_id, replica_id = in_flight.popleft()
            policy.on_completed(request_id)
            num_done[replica_id] += 1
    biggest = max(routed, key=lambda r: len(routed[r]))
    summary = CacheSummary(biggest, 10**6, clock.now, block_tokens, frozenset(routed[biggest]),  # a snapshot
                           epoch=_epoch(biggest) if fifo_full else "")
    started = time.perf_counter_ns()
    policy.on_summary(summary)
    summary_ms = (time.perf_counter_ns() - started) / 1e6
    return {"timings_us": timings_us, "wall_us": wall_us, "summary_us": summary_us,
            "summary_blocks": len(summary.block_hashes), "apply_summary_ms": summary_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="8,16,32,64")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--block-tokens", type=int, default=PolicyConfig().block_size)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy-args", type=json.loads, default={},
                        help="PolicyConfig knobs as JSON, e.g. '{\"split_affinity_by_holders\": false}'")
    parser.add_argument("--fifo-full", action="store_true",
                        help="replicas report full caches, one request running, one waiting and prefill counters: "
                             "the turnover term (turnover_weight) is in force")
    parser.add_argument("--fifo-room", action="store_true",
                        help="as --fifo-full, but every cache has room and the replicas report work counters and "
                             "output quantiles: the running request at what it has left (fifo_work_left)")
    parser.add_argument("--summary-every", type=int, default=100,
                        help="--fifo-full, --fifo-room: every replica reports its cache every this many decisions "
                             "(100 = each second at the bench's 100 decisions/s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of the same decisions per fleet size (each decision's fastest: its own cost)")
    parser.add_argument("--cold", action="store_true",
                        help="prompts share no prefix: every decision is a cold prompt's (with --fifo-room, "
                             "num_cold_candidates ring nodes compete)")
    parser.add_argument("--json", help="output JSON path")
    args = parser.parse_args(argv)
    fleet_sizes = [int(n) for n in args.replicas.split(",")]
    requests = _requests(args.warmup + args.requests, args.prompt_tokens, args.block_tokens, args.seed, args.cold)
    tokens = list(range(args.prompt_tokens))
    started = time.perf_counter_ns()
    for _ in range(200):
        block_hashes(tokens, args.block_tokens)
    hash_us = (time.perf_counter_ns() - started) / 1000 / 200
    if args.summary_every <= 0:
        parser.error("--summary-every must be positive")
    if args.repeats <= 0:
        parser.error("--repeats must be positive")
    if args.fifo_full and args.fifo_room:
        parser.error("--fifo-full and --fifo-room are two states: name one")
    results = [bench_fleet(n, requests, args.warmup, args.block_tokens, args.policy_args, args.fifo_full,
                           args.summary_every, args.repeats, args.fifo_room) for n in fleet_sizes]
    print(f"{args.prompt_tokens}-token prompts, block size {args.block_tokens} "
          f"({args.prompt_tokens // args.block_tokens} blocks); ingress block_hashes: {hash_us:.0f} us/prompt")
    print(f"{args.repeats} run(s) of the same decisions per fleet size; 'fastest p99': the p99 of each "
          "decision's fastest run")
    print(f"{'replicas':>8} {'cpu p50 us':>10} {'cpu p99 us':>10} {'fastest p99':>11} {'cpu max us':>10}"
          f" {'wall p50':>9} {'wall p99':>9} {'summary blocks':>15} {'apply ms':>9}")
    for r in results:
        print(f"{r['num_replicas']:>8} {r['decision_us_p50']:10.1f} {r['decision_us_p99']:10.1f} "
              f"{r['decision_us_p99_fastest']:11.1f} {r['decision_us_max']:10.0f} {r['wall_us_p50']:9.1f}"
              f" {r['wall_us_p99']:9.1f} {r['summary_blocks']:>15} {r['apply_summary_ms']:9.1f}")
    if args.fifo_full or args.fifo_room:
        print("periodic summaries (us per replica's summary): "
              + ", ".join(f"{r['num_replicas']} replicas p50 {r['periodic_summary_us_p50']:.0f} "
                          f"max {r['periodic_summary_us_max']:.0f}" for r in results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"prompt_tokens": args.prompt_tokens, "block_tokens": args.block_tokens, "cold": args.cold,
                       "ingress_block_hashes_us": hash_us, "fleets": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
