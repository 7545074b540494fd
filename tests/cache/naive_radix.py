"""A brute-force reference for RadixCache's observable behaviour (used by test_cache_model.py).

Cached positions are a flat dict ``(namespace, prefix) -> last access`` plus
the set of prefixes where a tree node ends; everything is done by brute
force: longest cached prefix by probing prefixes, LRU eviction by scanning for
the unlocked leaf node with the oldest access, live namespaces as a list in
order of use (a namespace is live while it holds a position or a lock; at the
cap the first one without a lock goes, whole).

Segmented LRU (``protected_share`` > 0): the sets of protected and of
reused positions; a counted match first adapts the target to a ghost where
it stopped (below), then protects and marks reused every position of every
node it runs through (the node it stops in wholly), then unprotects whole
nodes, least recent access first (of equal access the deepest), until at
most ``target`` positions are protected; an insert that splits a node
unprotects and unmarks the lower half; eviction takes the oldest unprotected
leaf, else the oldest protected one, and leaves a ghost keyed by the
namespace and the node's first position with everything above it: (its
positions, was it reused), at most ``budget`` positions of ghosts, oldest out
first. A counted match that stops at a ghost's key consumes it and moves the
target by its positions x max(1, the other kind's ghost positions / its
kind's): up for a reused ghost, down for a one-off one, within [0, budget].
"""

from collections import Counter


def namespace(salt):
    return salt.encode() if isinstance(salt, str) else salt


class NaiveRadix:
    """Brute-force reference for RadixCache's observable behaviour."""

    def __init__(self, budget_tokens, max_namespaces, protected_share=0.0):
        self.budget_tokens = budget_tokens
        self.target = int(protected_share * budget_tokens)
        self.is_adaptive = self.target > 0
        self.protected = set()  # (ns, prefix) positions in the protected segment
        self.reused = set()  # (ns, prefix) positions a counted match ran through while cached
        self.ghosts = {}  # hash((ns, prefix up to a node's first position)) -> (positions, reused); insertion order

        self.max_namespaces = max_namespaces
        self.live = []  # live namespaces, least recently used first
        self.time = 0
        self.access = {}  # (ns, prefix) -> last access; one entry per cached position
        self.node_ends = set()  # (ns, prefix) where a tree node ends
        self.pins = Counter()  # (ns, prefix) -> locks on the path ending there
        self.stats = Counter()

    # -- queries
    def cached_len(self, ns, tokens):
        k = 0
        while k < len(tokens) and (ns, tuple(tokens[: k + 1])) in self.access:
            k += 1
        return k

    def children(self, ns, prefix):
        return [p for (n, p) in self.access if n == ns and len(p) == len(prefix) + 1 and p[:-1] == prefix]

    def node_end(self, ns, prefix):
        """The end of the node holding position ``prefix``: nodes only branch where they end."""
        while (ns, prefix) not in self.node_ends:
            (prefix,) = self.children(ns, prefix)
        return prefix

    def node_positions(self, ns, end):
        start = len(end)
        while start > 1 and (ns, end[: start - 1]) not in self.node_ends:
            start -= 1
        return [end[:i] for i in range(start, len(end) + 1)]

    def is_pinned(self, ns, prefix):
        return any(n == ns and e[: len(prefix)] == prefix for (n, e), c in self.pins.items() if c)

    @property
    def num_tokens(self):
        return len(self.access)

    # -- updates
    def touch(self, ns, prefix):
        self.time += 1
        if ns in self.live:
            self.live.remove(ns)
            self.live.append(ns)
        if prefix:
            end = self.node_end(ns, tuple(prefix))
            for i in range(1, len(end) + 1):
                self.access[(ns, end[:i])] = self.time

    def match(self, tokens, salt, touch=True):
        self.prune()
        ns = namespace(salt)
        k = self.cached_len(ns, tokens)
        if touch:
            if k < len(tokens) and self.is_adaptive and ns in self.live:
                self.adapt(hash((ns, tuple(tokens[: k + 1]))))
            self.touch(ns, tokens[:k])
            if k and self.is_adaptive:
                end = self.node_end(ns, tuple(tokens[:k]))
                positions = {(ns, end[:i]) for i in range(1, len(end) + 1)}
                self.protected |= positions
                self.reused |= positions
            if self.is_adaptive:
                self.demote_overflow()
            if k:
                self.stats["hits"] += 1
                self.stats["tokens_saved"] += k
            else:
                self.stats["misses"] += 1
        if k:
            lock_key = (ns, self.node_end(ns, tuple(tokens[:k])))
        else:  # the namespace's root, or nothing in a namespace the cache does not hold
            lock_key = (ns, ()) if ns in self.live else None
        return k, lock_key

    def ghost_tokens(self, reused):
        return sum(n for n, r in self.ghosts.values() if r == reused)

    def adapt(self, key):
        if key not in self.ghosts:
            return
        num_tokens, was_reused = self.ghosts[key]
        one_off, reused = self.ghost_tokens(False), self.ghost_tokens(True)
        del self.ghosts[key]
        if was_reused:
            self.target = min(self.budget_tokens, self.target + int(num_tokens * max(1.0, one_off / max(reused, 1))))
        else:
            self.target = max(0, self.target - int(num_tokens * max(1.0, reused / max(one_off, 1))))

    def remember(self, ns, end, positions):
        if not self.is_adaptive:
            return
        start = len(positions[0])
        key = hash((ns, end[:start]))
        self.ghosts.pop(key, None)
        self.ghosts[key] = (len(positions), (ns, positions[0]) in self.reused)
        while sum(n for n, _ in self.ghosts.values()) > self.budget_tokens:
            del self.ghosts[next(iter(self.ghosts))]

    def demote_overflow(self):
        while len(self.protected) > self.target:
            ends = [(ns, end) for ns, end in self.node_ends if (ns, end) in self.protected]
            ns, end = min(ends, key=lambda e: (self.access[e], -len(e[1])))
            self.protected -= {(ns, p) for p in self.node_positions(ns, end)}

    def prune(self):
        """Drop the namespaces left with no position and no lock."""
        self.live = [ns for ns in self.live if any(n == ns for n, _ in self.access) or self.has_pins(ns)]

    def has_pins(self, ns):
        return any(n == ns and c for (n, _), c in self.pins.items())

    def evict_namespace(self, ns):
        positions = [p for p in self.access if p[0] == ns]
        nodes = [e for e in self.node_ends if e[0] == ns]
        for p in positions:
            del self.access[p]
        self.protected -= set(positions)
        self.reused -= set(positions)
        self.node_ends -= set(nodes)
        self.live.remove(ns)
        self.stats["evictions"] += len(nodes)
        self.stats["evicted_tokens"] += len(positions)
        self.stats["evicted_namespaces"] += 1

    def lock(self, key, delta=1):
        if key is not None:
            self.pins[key] += delta

    def evict(self, num_tokens):
        removed = 0
        while removed < num_tokens:
            leaves = []
            for ns, end in self.node_ends:
                if not self.children(ns, end) and not self.is_pinned(ns, end):
                    leaves.append(((ns, end) in self.protected, self.access[(ns, end)], ns, end))
            if not leaves:
                break
            leaves.sort(key=lambda leaf: leaf[:2])
            assert len(leaves) == 1 or leaves[0][:2] < leaves[1][:2], "two leaves share an access time"
            _, _, ns, end = leaves[0]
            positions = self.node_positions(ns, end)
            assert len({self.access[(ns, p)] for p in positions}) == 1, "a node's positions share one access time"
            self.remember(ns, end, positions)
            for p in positions:
                del self.access[(ns, p)]
                self.protected.discard((ns, p))
                self.reused.discard((ns, p))
            self.node_ends.discard((ns, end))
            removed += len(positions)
            self.stats["evictions"] += 1
            self.stats["evicted_tokens"] += len(positions)
        return removed

    def insert(self, tokens, salt):
        self.prune()
        ns, key = namespace(salt), tuple(tokens)
        if not key or len(key) > self.budget_tokens:
            return 0
        k = self.cached_len(ns, key)
        num_new = len(key) - k
        if num_new == 0:
            self.touch(ns, key)
            return 0
        pinned = {p for p in self.access if self.is_pinned(*p)} | {(ns, key[:i]) for i in range(1, k + 1)}
        if len(pinned) + num_new > self.budget_tokens:
            return 0
        if ns not in self.live:
            if len(self.live) >= self.max_namespaces:
                victims = [n for n in self.live if not self.has_pins(n)]
                if not victims:
                    self.stats["uncached_inserts"] += 1
                    return 0
                self.evict_namespace(victims[0])
            self.live.append(ns)
        if k:
            if (ns, key[:k]) not in self.node_ends:  # the split: the lower half is not what was shared
                lower_end = self.node_end(ns, key[:k])
                lower = {(ns, lower_end[:i]) for i in range(k + 1, len(lower_end) + 1)}
                self.protected -= lower
                self.reused -= lower
            self.node_ends.add((ns, key[:k]))
            self.pins[(ns, key[:k])] += 1
        self.evict(self.num_tokens + num_new - self.budget_tokens)
        if k:
            self.pins[(ns, key[:k])] -= 1
        for i in range(k + 1, len(key) + 1):
            self.access[(ns, key[:i])] = None
        self.node_ends.add((ns, key))
        self.touch(ns, key)
        self.stats["inserted_tokens"] += num_new
        return num_new
