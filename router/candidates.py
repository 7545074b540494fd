"""Which replicas compete for a request: the deepest holders of its prefix,
the replica holding its previous prompt's partial last block, the first ring
nodes from its key, and the least loaded (steps 1–3 of
:class:`router.policy.PrefixAffinityPolicy`)."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Collection, Iterator

import xxhash

from cache.hashing import salt_seed
from router.load import LoadTracker
from router.partial_blocks import PartialBlockIndex
from router.prefix_index import PrefixIndex
from router.request import RoutingRequest
from router.ring import HashRing

_U64 = struct.Struct("<Q")
_MASK_64 = (1 << 64) - 1


@dataclasses.dataclass(slots=True)
class Candidates:
    key: int  # ring key: the first block past what is cached anywhere (or the prompt's hash)
    replica_ids: list[str]  # holders deepest first, the within-block replica, ring nodes, the least loaded
    depths: dict[str, int]  # leading blocks each holder holds
    ring_rank: dict[str, int]  # position in the walk from ``key`` among live nodes; each one a candidate
    ring_walk: Iterator[str]  # the rest of that walk, for the spill
    within_replica: str | None  # holds the previous prompt's partial last block (and blocks 0..m-1)
    within_tokens: int  # tokens of block m cached there
    num_known: int  # m: leading blocks some replica is known to hold
    within_at_known: tuple[str, int] | None  # within_block() at depth m, before the live filter
    holder_levels: list[tuple[int, int]] | None = None  # PrefixIndex.deepest_holders' levels, if asked for

    @property
    def is_cold(self) -> bool:
        """No candidate holds any of the prompt: no known block, no within-block match."""
        return is_cold(self.depths, self.within_replica)

    def tiebreak(self, replica_id: str) -> int:
        """Rendezvous hash of (key, replica): the last tie-break."""
        return xxhash.xxh3_64_intdigest(_U64.pack(self.key & _MASK_64) + replica_id.encode())


def is_cold(depths: dict[str, int], within_replica: str | None) -> bool:
    """Whether a request with these holders (``Candidates.depths``,
    ``within_replica``) is cold: nothing of it is known held anywhere."""
    return not depths and within_replica is None


def within_block(partial: PartialBlockIndex | None, index: PrefixIndex, ring: HashRing,
                 request: RoutingRequest, depth: int, block_size: int) -> tuple[str, int] | None:
    """``(replica, tokens)`` of block ``depth`` an earlier prompt's partial
    last block shared, where that replica still holds blocks ``0..depth-1``.

    Given the prompt's token ids: the first ``sub_block_tokens`` multiples of
    block ``m`` (the first block no replica is known to hold) that an earlier
    prompt's *partial last block* shared, for the replica that prompt went to
    if it still holds blocks ``0..m-1`` (:class:`PartialBlockIndex`, at most
    ``block_size / sub_block_tokens - 1`` hashes). A chat's next turn extends
    its previous prompt, whose partial last block the index of full blocks
    cannot see; without it, when every replica holds the shared full blocks
    (a system prompt), the turn goes by load — and the recent-work tie-break
    then sends it *away* from its history. That replica joins the candidates.
    """
    if partial is None or not request.token_ids:
        return None
    hashes = request.block_hashes
    if depth > len(hashes):
        return None
    parent = hashes[depth - 1] if depth else salt_seed(request.salt)
    start = depth * block_size
    found = partial.match(parent, request.token_ids[start:start + partial.max_shared_tokens])
    if found is None or found[0] not in ring:
        return None
    if depth and not index.holds(found[0], parent):
        return None
    return found


def gather(request: RoutingRequest, live: Collection[str], index: PrefixIndex, ring: HashRing,
           loads: LoadTracker, partial: PartialBlockIndex | None, block_size: int,
           max_affinity_candidates: int, num_ring_candidates: int, with_levels: bool = False,
           num_cold_candidates: int | None = None) -> Candidates:
    """The candidates for ``request`` among ``live`` (with the prefix's
    holder counts if ``with_levels``); where nothing of it is known held,
    ``num_cold_candidates`` ring nodes compete if given, not
    ``num_ring_candidates``."""
    hashes = request.block_hashes
    levels: list[tuple[int, int]] | None = [] if with_levels else None
    num_known, depths = index.deepest_holders(hashes, max_affinity_candidates, live, levels)
    if hashes:
        key = hashes[min(num_known, len(hashes) - 1)]
    else:
        key = xxhash.xxh3_64_intdigest(request.prompt.encode("utf-8", "surrogatepass"))
    candidates = [r for r in depths if r in ring]
    within = within_block(partial, index, ring, request, num_known, block_size)
    within_replica, within_tokens = within if within and within[0] in live else (None, 0)
    if within_replica is not None:
        depths = depths | {within_replica: num_known}  # it holds blocks 0..m-1 (checked)
        if within_replica not in candidates:
            candidates.append(within_replica)
    ring_rank: dict[str, int] = {}
    if num_cold_candidates is not None and is_cold(depths, within_replica):
        num_ring_candidates = num_cold_candidates
    ring_walk = ring.walk(key)
    for replica_id in ring_walk:
        if replica_id in live:
            ring_rank[replica_id] = len(ring_rank)
            if replica_id not in depths:
                candidates.append(replica_id)
            if len(ring_rank) >= num_ring_candidates:
                break
    least = loads.least_loaded_replica()
    if least is not None and least in live and least not in candidates:
        candidates.append(least)
    return Candidates(key, candidates, depths, ring_rank, ring_walk, within_replica, within_tokens, num_known, within,
                      levels)
