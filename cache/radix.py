"""Token radix tree over cached KV blocks, under a token budget with LRU eviction.

Token-exact reuse: block ``j`` of a match is taken from the node holding the
match's last position in block ``j`` (the node layout that makes this valid is
in cache/radix_node.py). With no allocator the tree runs in *simulated* mode:
the same structure and eviction, no block ids (the router's simulator).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from cache.blocks import BlockAllocator
from cache.hashing import check_tokens
from cache.namespaces import Namespaces
from cache.radix_checks import audit_tree, check_arguments, check_block_ids
from cache.radix_node import Node, Root, blocks_along, descend, ghost_key, lookup_key, salt_key, split
from cache.radix_records import CachedEdge, CacheStats, MatchResult
from cache.segmented_lru import SegmentedLru

__all__ = ["CacheStats", "CachedEdge", "MatchResult", "RadixCache", "salt_key"]


class RadixCache:
    """Longest-prefix reuse of token sequences under ``budget_tokens``.

    Invariants (checked by :meth:`check_invariants`):

    1. ``num_tokens`` (sum of edge lengths: unique cached positions, a shared
       prefix counted once) ``<= budget_tokens``.
    2. Every non-root node has a non-empty edge, starts where its parent ends,
       and is keyed in its parent by its first token.
    3. ``lock_ref(n) >= sum(lock_ref(child))``: a lock pins its node and every
       ancestor; locked nodes are never evicted. Roots hold a permanent lock.
    4. In real mode each node holds a retained reference on each of its blocks,
       and blocks the tree names are never written again (writers copy first).
    5. Every live namespace holds a cached entry or a lock, and there are at
       most ``max_namespaces`` of them: memory is bounded by the budget and the
       cap, never by how many salts were ever seen.

    Eviction: when an insert needs room, unlocked leaves are removed least
    recently used first ("priority is last access time"; a lookup or insert
    touches every node on its path with one tick of ``clock``, ties go to the
    leaf that became evictable first). A parent left childless becomes a leaf
    candidate. An insert that cannot fit (longer than the budget, or blocked
    by locked positions: ``num_locked_tokens`` plus its cached prefix plus its
    new positions over budget) changes nothing and evicts nothing.

    With ``protected_share`` > 0 the order is segmented LRU
    (cache/segmented_lru.py): the nodes a counted lookup (``match`` with
    ``touch``) ran through or stopped in are *protected*, up to a target in
    positions (beyond it the least recently used are demoted), and
    unprotected leaves go first, least recently used first; protected leaves
    only when no unprotected one is left. An insert that splits a node leaves
    its lower half (not what the lookup shared) unprotected. The target
    starts at ``protected_share`` x the budget and adapts: evicted nodes leave
    ghosts (keyed by their first position with everything above it), and a
    counted lookup that stops where a ghost is moves the target towards the
    segment that ghost came from. 0 (the default) is plain LRU, no ghosts.

    Namespaces: each ``salt`` (tenant) has its own root, created by its first
    insert; entries never match across salts (``"a"`` and ``b"a"`` are the
    same salt, as for :func:`cache.block_hashes`); the budget is shared. A
    namespace left with no entry and no lock is dropped. An insert that would
    create namespace ``max_namespaces + 1`` first evicts, whole, the least
    recently used namespace with no lock in it (cache/namespaces.py); if every
    namespace holds a lock, the new one is served uncached (its inserts cache
    nothing, its lookups miss) and nothing else changes.

    Complexity: ``match`` and ``insert`` are O(len(tokens)) plus the dict
    lookups along the path, independent of how many entries are cached;
    eviction is O(log n) per leaf; evicting a namespace is O(its nodes).
    """

    def __init__(
        self,
        budget_tokens: int,
        block_size: int = 16,
        allocator: BlockAllocator | None = None,
        clock: Callable[[], float] | None = None,
        max_namespaces: int = 1024,
        protected_share: float = 0.0,
    ) -> None:
        check_arguments(budget_tokens, block_size, allocator, protected_share)
        self.budget_tokens = budget_tokens
        self.block_size = block_size
        self.allocator = allocator
        self.stats = CacheStats()
        self._clock = clock if clock is not None else itertools.count().__next__
        self._namespaces = Namespaces(max_namespaces)
        self._num_tokens = 0
        self._num_locked_tokens = 0  # edge lengths of non-root nodes with lock_ref > 0
        self._num_nodes = 0
        self._num_locks = 0
        self.protected_share = float(protected_share)
        self._lru: SegmentedLru[Node] = SegmentedLru(self._is_evictable, int(protected_share * budget_tokens),
                                                     budget_tokens)

    # ------------------------------------------------------------------ queries
    @property
    def num_tokens(self) -> int:
        """Unique cached positions (shared prefixes counted once)."""
        return self._num_tokens

    @property
    def num_locked_tokens(self) -> int:
        """Cached positions pinned by locks (never evicted until unlocked)."""
        return self._num_locked_tokens

    @property
    def num_locks(self) -> int:
        """Locks taken with :meth:`lock` and not yet undone."""
        return self._num_locks

    @property
    def num_protected_tokens(self) -> int:
        """Cached positions in the protected segment (reused by a lookup; ``<= protected_target_tokens``)."""
        return self._lru.num_protected_tokens

    @property
    def protected_target_tokens(self) -> int:
        """The protected segment's adaptive bound in positions (``protected_share`` x budget at the start)."""
        return self._lru.protected_target

    @property
    def num_ghost_tokens(self) -> tuple[int, int]:
        """Positions of evicted nodes remembered for the target's adaptation: (never reused, reused)."""
        return self._lru.num_ghost_tokens

    @property
    def num_nodes(self) -> int:
        """Edges in the tree, all namespaces (what :meth:`edges` yields); <= ``num_tokens``."""
        return self._num_nodes

    @property
    def num_namespaces(self) -> int:
        """Live namespaces (salts with a cached entry or a lock); <= ``max_namespaces``."""
        return len(self._namespaces)

    @property
    def max_namespaces(self) -> int:
        return self._namespaces.max_namespaces

    @property
    def is_simulated(self) -> bool:
        return self.allocator is None

    def match(self, tokens: Sequence[int], salt: str | bytes | None = None, *, touch: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens`` in the ``salt`` namespace.

        With ``touch`` (default) the path's LRU time is refreshed and the lookup
        counts in :attr:`stats`; ``touch=False`` is a pure read. Never splits,
        never creates a namespace (a miss in an unknown one is harmless to lock).
        """
        check_tokens(tokens)
        root = self._namespaces.get(salt_key(salt))
        if root is None:
            if touch:
                self.stats.misses += 1
            return MatchResult(0, (), Root(salt_key(salt)))
        key = tuple(tokens)
        path, num_matched, cut = descend(root, key)
        if cut is not None:
            path.append(cut[0])
        if touch:
            if num_matched < len(key) and self._lru.is_adaptive:  # missed where a ghost may be
                self._lru.adapt_on_miss(lookup_key(root.namespace, key[: num_matched + 1]))
            if num_matched:
                self._lru.protect(path[1:])  # reused: protected (a no-op under plain LRU)
            self._touch(path)
            self._lru.demote_overflow(self._is_evictable)
            if num_matched:
                self.stats.hits += 1
                self.stats.tokens_saved += num_matched
            else:
                self.stats.misses += 1
        block_ids = () if self.allocator is None else blocks_along(path, num_matched, self.block_size)
        return MatchResult(num_matched, block_ids, path[-1])

    def edges(self) -> Iterator[CachedEdge]:
        """Every node of every namespace, depth first (a node before its children;
        namespaces least recently used first). A pure read: no LRU touch, no
        stats. O(``num_nodes``); do not change the tree while iterating."""
        for root in self._namespaces:
            namespace = root.namespace
            stack = [(child, 0) for child in reversed(root.children.values())]
            while stack:
                node, depth = stack.pop()
                yield CachedEdge(namespace, depth, node.start, node.tokens, tuple(node.block_ids), node.lock_ref)
                if node.children:
                    depth += 1
                    for child in reversed(node.children.values()):
                        stack.append((child, depth))

    # ------------------------------------------------------------------ updates
    def insert(
        self,
        tokens: Sequence[int],
        block_ids: Sequence[int] | None = None,
        salt: str | bytes | None = None,
        *,
        is_copy: bool = False,
    ) -> int:
        """Cache ``tokens``; returns how many positions were newly cached.

        Real mode: ``block_ids`` is the sequence's block table (at least
        ``ceil(len(tokens) / block_size)`` ids, valid for every position); the
        tree retains the blocks of the new suffix. Simulated mode: omit it.
        Evicts LRU leaves to stay within budget (and a whole namespace to stay
        within ``max_namespaces``). If ``tokens`` is longer than the budget, or
        what is locked (plus the cached prefix of ``tokens``) leaves no room,
        or it needs a new namespace and every namespace is locked, nothing
        changes at all: nothing cached, nothing evicted, no split, no LRU
        touch. Splits the edge where ``tokens`` leaves the tree. ``is_copy``:
        the new positions are KV imported from another cache (segmented LRU:
        protected only when a second lookup here reuses them).
        """
        check_tokens(tokens)
        key = tuple(tokens)
        namespace = salt_key(salt)
        check_block_ids(self.allocator, self.block_size, len(key), block_ids)
        if not key or len(key) > self.budget_tokens:
            return 0
        root = self._namespaces.get(namespace)
        is_new_namespace = root is None
        if is_new_namespace:
            root = Root(namespace)
        path, pos, cut = descend(root, key)
        num_new = len(key) - pos
        if num_new == 0:  # already cached (possibly inside an edge)
            self._touch(path if cut is None else path + [cut[0]])
            return 0
        num_pinned = self._num_locked_tokens + sum(len(n.tokens) for n in path if n.lock_ref == 0)
        if cut is not None and cut[0].lock_ref == 0:
            num_pinned += cut[1]
        if num_pinned + num_new > self.budget_tokens:
            return 0  # eviction could not make room: change nothing
        if is_new_namespace:
            if self._namespaces.is_full:
                victim = self._namespaces.least_recent_unlocked()
                if victim is None:
                    self.stats.uncached_inserts += 1
                    return 0  # every namespace is in use: serve this one uncached
                self._evict_namespace(victim)
            self._namespaces.add(root)
        leaf = Node(key[pos:], pos, None)
        leaf.is_copy = is_copy
        if self.allocator is not None:
            first, last = pos // self.block_size, (len(key) - 1) // self.block_size
            leaf.block_ids = list(block_ids[first : last + 1])
            for block_id in leaf.block_ids:  # before evicting, so eviction cannot free them
                self.allocator.retain(block_id)
        if cut is not None:
            upper, shared_block = split(*cut, self.block_size)
            if shared_block is not None:  # both halves name it now
                self.allocator.retain(shared_block)
            lower = cut[0]  # not what a lookup stopping in the edge shared: neither reused nor protected
            lower.was_reused = False
            self._lru.demote(lower, self._is_evictable)  # (the upper half is queued by the path's touch)
            self._num_nodes += 1
            path.append(upper)
        node = path[-1]
        self._lock_node(node)  # pin the path (and the new namespace) while making room
        try:
            self.evict(self._num_tokens + num_new - self.budget_tokens)
            assert self._num_tokens + num_new <= self.budget_tokens, "room was counted before evicting"
            leaf.parent = node
            node.children[key[pos]] = leaf
            self._num_tokens += num_new
            self._num_nodes += 1
        finally:
            self._unlock_node(node)
        self.stats.inserted_tokens += num_new
        path.append(leaf)
        self._touch(path)
        return num_new

    def lock(self, match: MatchResult) -> None:
        """Pin the positions ``match`` found against eviction (counted: lock twice,
        unlock twice). Lock before the next insert or evict, which may remove an
        unlocked entry (locking one that was evicted raises ``ValueError``:
        match again). A lock in a namespace also keeps the namespace alive."""
        node = match._node
        if not node.is_root and not node.is_attached():
            raise ValueError(f"lock of a node that was evicted: {node!r}")
        self._lock_node(node)

    def unlock(self, match: MatchResult) -> None:
        """Undo one :meth:`lock` of ``match``."""
        node = match._node
        if node.lock_ref <= (1 if node.is_root else 0):
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        self._unlock_node(node)

    def evict(self, num_tokens: int) -> int:
        """Remove LRU unlocked leaves until ``num_tokens`` positions are gone.

        Returns the number of positions removed (may exceed the request by up
        to one leaf, or fall short when everything left is locked). In real
        mode the blocks' retained references are released.
        """
        removed = 0
        while removed < num_tokens:
            leaf = self._lru.pop()
            if leaf is None:
                break
            removed += self._remove_leaf(leaf)
        return removed

    def clear(self) -> int:
        """Evict everything that is not locked; returns positions removed."""
        return self.evict(self._num_tokens)

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Assert the class docstring's invariants (:func:`cache.radix_checks.audit_tree`)."""
        audit_tree(self)

    # ----------------------------------------------------------------- private
    def _lock_node(self, node: Node | None) -> None:
        self._num_locks += 1
        while node is not None:
            if node.lock_ref == 0:
                self._num_locked_tokens += len(node.tokens)
            node.lock_ref += 1
            node = node.parent

    def _unlock_node(self, node: Node) -> None:
        self._num_locks -= 1
        while True:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked_tokens -= len(node.tokens)
                if not node.children:
                    self._lru.push(node)
            if node.parent is None:
                break
            node = node.parent
        self._drop_if_empty(node)

    def _touch(self, path: list[Node]) -> None:
        now = self._clock()
        for node in path:
            node.last_access = now
        self._lru.touched(path)
        self._namespaces.touch(path[0])
        leaf = path[-1]
        if self._is_evictable(leaf):
            self._lru.push(leaf)

    @staticmethod
    def _is_evictable(node: Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0 and node.is_attached()

    def _remove_leaf(self, leaf: Node) -> int:
        parent = leaf.parent
        num_removed = self._detach(leaf)
        if self._is_evictable(parent):
            self._lru.push(parent)
        elif parent.is_root:
            self._drop_if_empty(parent)
        return num_removed

    def _detach(self, leaf: Node, leaves_ghost: bool = True) -> int:
        """Remove ``leaf``; an LRU eviction leaves a ghost (a tenant evicted whole does not)."""
        if leaves_ghost and self._lru.is_adaptive:
            self._lru.remember_eviction(ghost_key(leaf), len(leaf.tokens), leaf.was_reused)
        del leaf.parent.children[leaf.tokens[0]]
        self._lru.forget(leaf)
        if self.allocator is not None:
            for block_id in leaf.block_ids:
                self.allocator.release(block_id)
        num_removed = len(leaf.tokens)
        self._num_tokens -= num_removed
        self._num_nodes -= 1
        self.stats.evictions += 1
        self.stats.evicted_tokens += num_removed
        return num_removed

    def _drop_if_empty(self, root: Node) -> None:
        """Forget a namespace with no entry and no lock (invariant 5)."""
        if not root.children and root.lock_ref == 1 and self._namespaces.holds(root):
            self._namespaces.drop(root)

    def _evict_namespace(self, root: Root) -> None:
        """Remove every entry of an unlocked namespace, then the namespace."""
        assert root.lock_ref == 1, root.namespace
        preorder, stack = [], list(root.children.values())
        while stack:
            node = stack.pop()
            preorder.append(node)
            stack.extend(node.children.values())
        for node in reversed(preorder):  # children before parents: each is a leaf when detached
            self._detach(node, leaves_ghost=False)
        self._namespaces.drop(root)
        self.stats.evicted_namespaces += 1
