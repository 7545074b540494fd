"""A brute-force reference for RadixCache's observable behaviour (used by test_cache_model.py).

Cached positions are a flat dict ``(namespace, prefix) -> last access`` plus
the set of prefixes where a tree node ends; everything is done by brute
force: longest cached prefix by probing prefixes, LRU eviction by scanning for
the unlocked leaf node with the oldest access, live namespaces as a list in
order of use (a namespace is live while it holds a position or a lock; at the
cap the first one without a lock goes, whole).
"""

from collections import Counter


def namespace(salt):
    return salt.encode() if isinstance(salt, str) else salt


class NaiveRadix:
    """Brute-force reference for RadixCache's observable behaviour."""

    def __init__(self, budget_tokens, max_namespaces):
        self.budget_tokens = budget_tokens
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
            self.touch(ns, tokens[:k])
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
                    leaves.append((self.access[(ns, end)], ns, end))
            if not leaves:
                break
            leaves.sort(key=lambda leaf: leaf[0])
            assert len(leaves) == 1 or leaves[0][0] < leaves[1][0], "two leaves share an access time"
            _, ns, end = leaves[0]
            positions = self.node_positions(ns, end)
            assert len({self.access[(ns, p)] for p in positions}) == 1, "a node's positions share one access time"
            for p in positions:
                del self.access[(ns, p)]
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
            self.node_ends.add((ns, key[:k]))  # the split
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
