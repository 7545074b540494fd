"""Token radix tree over cached KV blocks, under a token budget with LRU eviction.

Layout of a node: its edge ``tokens`` holds absolute positions
``[start, end)``; its ``block_ids`` hold the physical blocks for block indices
``start // block_size .. (end - 1) // block_size``. A node's first block may
begin before ``start`` (the edge starts mid-block); its rows before ``start``
hold the KV of the same tokens (they are the path above), so every block a node
names is valid from the block's first position up to ``end``. That rule makes
token-exact reuse work: block ``j`` of a match is taken from the node holding
the match's last position in block ``j``.

With no allocator the tree runs in *simulated* mode: the same structure and
eviction, no block ids. The router's simulator replays traces through it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.blocks import BlockAllocator
from cache.hashing import check_tokens
from cache.lru import LruQueue

SaltKey = bytes | None


def salt_key(salt: str | bytes | None) -> SaltKey:
    """The namespace a salt names: ``"a"`` and ``b"a"`` are one tenant, as in
    :func:`cache.hashing.salt_seed`."""
    if salt is None or isinstance(salt, bytes):
        return salt
    if isinstance(salt, str):
        return salt.encode()
    raise TypeError(f"salt must be str, bytes or None, got {salt!r} ({type(salt).__name__})")


@dataclass(slots=True)
class CacheStats:
    """Counters since construction. Only ``match(..., touch=True)`` counts lookups."""

    hits: int = 0  # lookups that reused >= 1 token
    misses: int = 0
    tokens_saved: int = 0  # sum of matched tokens over lookups
    inserted_tokens: int = 0
    evictions: int = 0  # leaves removed
    evicted_tokens: int = 0


class _Node:
    __slots__ = ("tokens", "start", "block_ids", "parent", "children", "lock_ref", "last_access")

    def __init__(self, tokens: tuple[int, ...], start: int, parent: _Node | None) -> None:
        self.tokens = tokens
        self.start = start
        self.block_ids: list[int] = []
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.lock_ref = 0
        self.last_access: float = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"_Node([{self.start}, {self.end}), blocks={self.block_ids}, lock={self.lock_ref})"


def _new_root() -> _Node:
    root = _Node((), 0, None)
    root.lock_ref = 1  # permanent: a root is never evicted
    return root


def _is_attached(node: _Node) -> bool:
    """Still in its parent's children (not evicted). Ancestors of an attached
    node are attached: only childless nodes are removed."""
    return node.parent.children.get(node.tokens[0]) is node


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a lookup.

    ``block_ids``: ``ceil(num_tokens / block_size)`` blocks holding positions
    ``[0, num_tokens)`` (empty in simulated mode); all but a partly matched last
    one can be shared by reference, that one must be copied before writing.
    ``node``: lock it (:meth:`RadixCache.lock`) while the blocks are in use.
    """

    num_tokens: int
    block_ids: tuple[int, ...]
    node: _Node


def _common_prefix_len(edge: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
    """How many leading tokens of ``edge`` equal ``tokens[pos:]``. O(len(edge))."""
    limit = min(len(edge), len(tokens) - pos)
    if tokens[pos : pos + limit] == edge[:limit]:  # C-speed common case
        return limit
    for offset in range(limit):
        if edge[offset] != tokens[pos + offset]:
            return offset
    return limit


class RadixCache:
    """Longest-prefix reuse of token sequences under ``budget_tokens``.

    Invariants (checked by :meth:`check_invariants`):

    1. ``num_tokens`` (sum of edge lengths: unique cached positions, a shared
       prefix counted once) ``<= budget_tokens``.
    2. Every non-root node has a non-empty edge, starts where its parent ends,
       and is keyed in its parent by its first token.
    3. ``lock_ref(n) >= sum(lock_ref(child))``: a lock pins its node and every
       ancestor; locked nodes are never evicted. Roots are locked for good.
    4. In real mode each node holds a retained reference on each of its blocks,
       and blocks the tree names are never written again (writers copy first).

    Eviction: when an insert needs room, unlocked leaves are removed least
    recently used first ("priority is last access time"; a lookup or insert
    touches every node on its path with one tick of ``clock``, ties go to the
    leaf that became evictable first). A parent left childless becomes a leaf
    candidate. An insert that cannot fit (longer than the budget, or blocked
    by locked positions: ``num_locked_tokens`` plus its cached prefix plus its
    new positions over budget) changes nothing and evicts nothing.

    Namespaces: each ``salt`` (tenant) has its own root, created by its first
    insert; entries never match across salts (``"a"`` and ``b"a"`` are the
    same salt, as for :func:`cache.block_hashes`). The budget is shared.

    Complexity: ``match`` and ``insert`` are O(len(tokens)) plus the dict
    lookups along the path, independent of how many entries are cached;
    eviction is O(log n) per leaf.
    """

    def __init__(
        self,
        budget_tokens: int,
        block_size: int = 16,
        allocator: BlockAllocator | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if type(budget_tokens) is not int or budget_tokens < 0:
            raise ValueError(f"budget_tokens must be a non-negative int, got {budget_tokens!r}")
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if allocator is not None and allocator.block_size != block_size:
            raise ValueError(f"allocator block_size {allocator.block_size} != block_size {block_size}")
        self.budget_tokens = budget_tokens
        self.block_size = block_size
        self.allocator = allocator
        self.stats = CacheStats()
        self._clock = clock if clock is not None else itertools.count().__next__
        self._roots: dict[SaltKey, _Node] = {}
        self._num_tokens = 0
        self._num_locked_tokens = 0  # edge lengths of non-root nodes with lock_ref > 0
        self._num_nodes = 0
        self._lru: LruQueue[_Node] = LruQueue(self._is_evictable)

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
    def is_simulated(self) -> bool:
        return self.allocator is None

    def match(self, tokens: Sequence[int], salt: str | bytes | None = None, *, touch: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens`` in the ``salt`` namespace.

        With ``touch`` (default) the path's LRU time is refreshed and the lookup
        counts in :attr:`stats`; ``touch=False`` is a pure read. Never splits,
        never creates a namespace (a miss in an unknown one returns a fresh,
        unattached root, harmless to lock).
        """
        check_tokens(tokens)
        root = self._roots.get(salt_key(salt))
        if root is None:
            if touch:
                self.stats.misses += 1
            return MatchResult(0, (), _new_root())
        num_matched, block_ids, path = self._walk(root, tuple(tokens))
        if touch:
            self._touch(path)
            if num_matched:
                self.stats.hits += 1
                self.stats.tokens_saved += num_matched
            else:
                self.stats.misses += 1
        return MatchResult(num_matched, tuple(block_ids), path[-1])

    # ------------------------------------------------------------------ updates
    def insert(
        self,
        tokens: Sequence[int],
        block_ids: Sequence[int] | None = None,
        salt: str | bytes | None = None,
    ) -> int:
        """Cache ``tokens``; returns how many positions were newly cached.

        Real mode: ``block_ids`` is the sequence's block table (at least
        ``ceil(len(tokens) / block_size)`` ids, valid for every position); the
        tree retains the blocks of the new suffix. Simulated mode: omit it.
        Evicts LRU leaves to stay within budget. If ``tokens`` is longer than
        the budget, or what is locked (plus the cached prefix of ``tokens``)
        leaves no room, nothing changes at all: nothing cached, nothing
        evicted, no split, no LRU touch. Splits the edge where ``tokens``
        leaves the tree.
        """
        check_tokens(tokens)
        key = tuple(tokens)
        namespace = salt_key(salt)
        num_needed_blocks = -(-len(key) // self.block_size)
        if self.allocator is None:
            if block_ids is not None:
                raise ValueError("simulated RadixCache takes no block_ids")
        elif block_ids is None or len(block_ids) < num_needed_blocks:
            got = "none" if block_ids is None else len(block_ids)
            raise ValueError(f"{len(key)} tokens need {num_needed_blocks} block ids, got {got}")
        else:
            for block_id in block_ids[:num_needed_blocks]:
                if self.allocator.ref_count(block_id) == 0:
                    raise ValueError(f"insert names free block {block_id}; cache only blocks a sequence holds")
        if not key or len(key) > self.budget_tokens:
            return 0
        root = self._roots.get(namespace)
        if root is None:
            root = _new_root()
        path, pos, cut = self._descend(root, key)
        num_new = len(key) - pos
        if num_new == 0:  # already cached (possibly inside an edge)
            self._touch(path if cut is None else path + [cut[0]])
            return 0
        num_pinned = self._num_locked_tokens + sum(len(n.tokens) for n in path if n.lock_ref == 0)
        if cut is not None and cut[0].lock_ref == 0:
            num_pinned += cut[1]
        if num_pinned + num_new > self.budget_tokens:
            return 0  # eviction could not make room: change nothing
        self._roots.setdefault(namespace, root)
        leaf = _Node(key[pos:], pos, None)
        if self.allocator is not None:
            first, last = pos // self.block_size, (len(key) - 1) // self.block_size
            leaf.block_ids = list(block_ids[first : last + 1])
            for block_id in leaf.block_ids:  # before evicting, so eviction cannot free them
                self.allocator.retain(block_id)
        if cut is not None:
            path.append(self._split(*cut))
        node = path[-1]
        self.lock(node)  # pin the path while making room
        try:
            self.evict(self._num_tokens + num_new - self.budget_tokens)
            assert self._num_tokens + num_new <= self.budget_tokens, "room was counted before evicting"
            leaf.parent = node
            node.children[key[pos]] = leaf
            self._num_tokens += num_new
            self._num_nodes += 1
        finally:
            self.unlock(node)
        self.stats.inserted_tokens += num_new
        path.append(leaf)
        self._touch(path)
        return num_new

    def lock(self, node: _Node) -> None:
        """Pin ``node`` and its ancestors against eviction (counted: lock twice, unlock twice).

        ``node`` is a :attr:`MatchResult.node`; lock it before the next insert
        or evict, which may remove an unlocked node (locking one that was
        evicted raises ``ValueError``: match again).
        """
        if not node.is_root and not _is_attached(node):
            raise ValueError(f"lock of a node that was evicted: {node!r}")
        while node is not None:
            if node.lock_ref == 0:
                self._num_locked_tokens += len(node.tokens)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        """Undo one :meth:`lock` of ``node``."""
        if node.lock_ref <= (1 if node.is_root else 0):
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked_tokens -= len(node.tokens)
                if not node.children:
                    self._lru.push(node)
            node = node.parent

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
        total_tokens, total_nodes, locked_tokens = 0, 0, 0
        retained: dict[int, int] = {}
        queued = self._lru.live_keys()
        for namespace, root in self._roots.items():
            assert namespace is None or type(namespace) is bytes, namespace
            assert root.is_root and root.lock_ref >= 1 and root.start == 0 and not root.tokens
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for first, child in node.children.items():
                    assert child.tokens and child.tokens[0] == first, child
                    assert child.parent is node and child.start == node.end, child
                    child_locks += child.lock_ref
                    stack.append(child)
                assert node.lock_ref >= child_locks, node
                if node.is_root:
                    continue
                total_tokens += len(node.tokens)
                total_nodes += 1
                if node.lock_ref:
                    locked_tokens += len(node.tokens)
                assert node.last_access >= max((c.last_access for c in node.children.values()), default=0)
                if self._is_evictable(node):
                    assert (id(node), node.last_access) in queued, f"evictable leaf not queued: {node!r}"
                if self.allocator is not None:
                    first, last = node.start // self.block_size, (node.end - 1) // self.block_size
                    assert len(node.block_ids) == last - first + 1, node
                    for block_id in node.block_ids:
                        retained[block_id] = retained.get(block_id, 0) + 1
        assert total_tokens == self._num_tokens <= self.budget_tokens, (total_tokens, self._num_tokens)
        assert locked_tokens == self._num_locked_tokens, (locked_tokens, self._num_locked_tokens)
        assert total_nodes == self._num_nodes
        if self.allocator is not None:
            for block_id, count in retained.items():
                assert self.allocator.retained_count(block_id) == count, block_id

    # ----------------------------------------------------------------- private
    def _walk(self, root: _Node, key: tuple[int, ...]) -> tuple[int, list[int], list[_Node]]:
        """Descend along ``key``: (matched length, block ids, path); ``path[-1]``
        is the deepest node reached (the match may end inside its edge)."""
        bs = self.block_size
        node, pos, block_ids, path = root, 0, [], [root]
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            matched = _common_prefix_len(child.tokens, key, pos)
            path.append(child)
            if child.block_ids:
                first = child.start // bs
                for index in range(first, (pos + matched - 1) // bs + 1):
                    block_id = child.block_ids[index - first]
                    if index < len(block_ids):
                        block_ids[index] = block_id  # later node holds more valid rows
                    else:
                        block_ids.append(block_id)
            pos += matched
            if matched < len(child.tokens):
                break
            node = child
        return pos, block_ids, path

    @staticmethod
    def _descend(root: _Node, key: tuple[int, ...]) -> tuple[list[_Node], int, tuple[_Node, int] | None]:
        """Where ``key`` leaves the tree: (path of wholly matched nodes, matched
        length, ``(child, offset)`` if it stops ``offset`` tokens into
        ``child``'s edge). Changes nothing."""
        node, pos, path = root, 0, [root]
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            matched = _common_prefix_len(child.tokens, key, pos)
            pos += matched
            if matched < len(child.tokens):
                return path, pos, (child, matched)
            path.append(child)
            node = child
        return path, pos, None

    def _split(self, child: _Node, offset: int) -> _Node:
        """Cut ``child``'s edge after ``offset`` tokens; returns the new upper node."""
        bs = self.block_size
        parent = child.parent
        upper = _Node(child.tokens[:offset], child.start, parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        cut = child.start + offset
        if child.block_ids:
            first = child.start // bs
            upper.block_ids = child.block_ids[: (cut - 1) // bs - first + 1]
            child.block_ids = child.block_ids[cut // bs - first :]
            if cut % bs:  # the block straddling the cut is now named by both nodes
                self.allocator.retain(child.block_ids[0])
        child.tokens = child.tokens[offset:]
        child.start = cut
        child.parent = upper
        upper.children[child.tokens[0]] = child
        parent.children[upper.tokens[0]] = upper
        self._num_nodes += 1
        return upper

    def _touch(self, path: list[_Node]) -> None:
        now = self._clock()
        for node in path:
            node.last_access = now
        leaf = path[-1]
        if self._is_evictable(leaf):
            self._lru.push(leaf)

    @staticmethod
    def _is_evictable(node: _Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0 and _is_attached(node)

    def _remove_leaf(self, leaf: _Node) -> int:
        parent = leaf.parent
        del parent.children[leaf.tokens[0]]
        if self.allocator is not None:
            for block_id in leaf.block_ids:
                self.allocator.release(block_id)
        num_removed = len(leaf.tokens)
        self._num_tokens -= num_removed
        self._num_nodes -= 1
        self.stats.evictions += 1
        self.stats.evicted_tokens += num_removed
        if self._is_evictable(parent):
            self._lru.push(parent)
        return num_removed
