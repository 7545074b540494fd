"""Blocks a replica is promised but has not computed yet: the ones its
in-flight requests add to what it held when they were routed there."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from router.chain_search import last_true


class PendingBlocks:
    """Per replica, the block hashes that in-flight requests routed there
    will compute (those past what the replica held when each was routed),
    until each request completes.

    The router learns a request's blocks at its replica the moment it routes
    it (:meth:`PrefixIndex.learn`), so the next request sharing them is drawn
    there at once. Saving the prefill is real then (the engine shares a
    prefix being computed). The affinity premium is not: it stands for later
    requests that will find the prefix cached *only* there, but a prefix
    nobody has computed yet has cost nothing to place, and a burst of cold
    conversations on one system prompt, all arriving before the first is
    computed, would follow the first to its replica (live, 2 Workers, 8
    concurrent chats: 8 of 8 on one, then half of them moved mid-chat;
    BENCHMARKS.md "A burst of chats herds behind a prefix still in flight").
    :meth:`users` says how many in-flight requests there wait on a pending
    block (the first one each found pending), so the policy can tell such a
    burst from a group's two prompts arriving together.

    Computed blocks of a chain form a prefix of it (a block is computed after
    its ancestors), so :meth:`computed_depth` is a binary search.

    Invariants (checked by :meth:`check_invariants`): ``_count[r][h]`` is the
    number of in-flight requests at ``r`` that listed ``h``, ``_users[r][h]``
    the number whose first pending block there is ``h``, neither ever 0;
    every request is counted at exactly one replica, in the order they were
    added.
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s  # a request never reported complete is forgotten after this
        self._by_request: dict[str, tuple[str, tuple[int, ...], float, int | None]] = {}  # oldest first
        self._count: dict[str, Counter[int]] = {}
        self._users: dict[str, dict[int, int]] = {}  # replica -> first pending block -> requests using it

    def __len__(self) -> int:
        return len(self._by_request)

    def add(self, request_id: str, replica_id: str, block_hashes: Sequence[int], now: float,
            anchor: int | None = None) -> None:
        """``request_id`` will compute ``block_hashes`` at ``replica_id`` (a
        request counted again, e.g. moved to another replica, replaces its
        earlier entry). Entries older than the timeout go first."""
        self.done(request_id)
        while self._by_request:
            oldest, (_, _, added, _) = next(iter(self._by_request.items()))
            if now - added <= self._timeout_s:
                break
            self.done(oldest)
        hashes = tuple(block_hashes)
        if not hashes and anchor is None:
            return
        if hashes:
            counts = self._count.get(replica_id)
            if counts is None:
                counts = self._count[replica_id] = Counter()
            counts.update(hashes)  # counted in C: a prompt's worth of blocks a decision
        if anchor is not None:
            users = self._users.setdefault(replica_id, {})
            users[anchor] = users.get(anchor, 0) + 1
        self._by_request[request_id] = (replica_id, hashes, now, anchor)

    def users(self, replica_id: str, block_hash: int) -> int:
        """In-flight requests at ``replica_id`` whose first pending block there is ``block_hash``."""
        return self._users.get(replica_id, {}).get(block_hash, 0)

    def done(self, request_id: str) -> None:
        """The request completed (or was forgotten): its blocks are computed."""
        entry = self._by_request.pop(request_id, None)
        if entry is None:
            return
        replica_id, hashes, _, anchor = entry
        _decrement(self._count, replica_id, hashes)
        if anchor is not None:
            _decrement(self._users, replica_id, (anchor,))

    def remove_replica(self, replica_id: str) -> None:
        for request_id in [r for r, entry in self._by_request.items() if entry[0] == replica_id]:
            self.done(request_id)

    def has_pending(self, replica_id: str) -> bool:
        return replica_id in self._count

    def computed_depth(self, replica_id: str, block_hashes: Sequence[int], depth: int) -> int:
        """Of the first ``depth`` blocks of a chain ``replica_id`` holds, how
        many are computed (the leading ones no in-flight request there still
        has to compute). O(log depth)."""
        counts = self._count.get(replica_id)
        if not counts or depth <= 0 or block_hashes[depth - 1] not in counts:
            return depth
        return last_true(depth, lambda d: block_hashes[d - 1] not in counts)

    def computes(self, replica_id: str, block_hashes: Sequence[int], depth: int) -> bool:
        """Whether a request in flight at ``replica_id`` still computes one of
        the first ``depth`` blocks of the chain (:meth:`computed_depth` < ``depth``)."""
        return replica_id in self._count and self.computed_depth(replica_id, block_hashes, depth) < depth

    def check_invariants(self) -> None:
        expected: dict[str, dict[int, int]] = {}
        users: dict[str, dict[int, int]] = {}
        for replica_id, hashes, _, anchor in self._by_request.values():
            if hashes:
                counts = expected.setdefault(replica_id, {})
                for block_hash in hashes:
                    counts[block_hash] = counts.get(block_hash, 0) + 1
            if anchor is not None:
                users.setdefault(replica_id, {})[anchor] = users.get(replica_id, {}).get(anchor, 0) + 1
        assert expected == self._count, "pending counts disagree with the requests in flight"
        assert users == self._users, "users of pending blocks disagree with the requests in flight"
        added = [entry[2] for entry in self._by_request.values()]
        assert added == sorted(added), "pending requests out of order"


def _decrement(table: dict[str, dict[int, int]], replica_id: str, block_hashes: Sequence[int]) -> None:
    """One fewer for each of ``block_hashes`` at ``replica_id``; zeros and empty replicas dropped."""
    if not block_hashes:
        return
    counts = table[replica_id]
    for block_hash in block_hashes:
        left = counts[block_hash] - 1
        if left:
            counts[block_hash] = left
        else:
            del counts[block_hash]
    if not counts:
        del table[replica_id]
