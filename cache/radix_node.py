"""The radix tree's node and namespace root, and the pure helpers on edges: the
tree's internals (cache/radix.py, its checks in cache/radix_checks.py, its
namespaces and records); no other module reads them.

Layout of a node: its edge ``tokens`` holds absolute positions
``[start, end)``; its ``block_ids`` hold the physical blocks for block indices
``start // block_size .. (end - 1) // block_size``. A node's first block may
begin before ``start`` (the edge starts mid-block); its rows before ``start``
hold the KV of the same tokens (they are the path above), so every block a node
names is valid from the block's first position up to ``end``.
"""

from __future__ import annotations

import itertools

from collections.abc import Iterator

SaltKey = bytes | None  # a namespace: the salt as bytes, or None (no salt)


def salt_key(salt: str | bytes | None) -> SaltKey:
    """The namespace a salt names: ``"a"`` and ``b"a"`` are one tenant, as in
    :func:`cache.hashing.salt_seed`."""
    if salt is None or isinstance(salt, bytes):
        return salt
    if isinstance(salt, str):
        return salt.encode()
    raise TypeError(f"salt must be str, bytes or None, got {salt!r} ({type(salt).__name__})")


class Node:
    """One edge of the tree. ``lock_ref`` counts the locks held on this node or
    below it; ``last_access`` is the clock tick of the last lookup or insert
    whose path ran through it."""

    __slots__ = ("tokens", "start", "block_ids", "parent", "children", "lock_ref", "last_access", "is_protected", "was_reused",
                 "is_copy")

    def __init__(self, tokens: tuple[int, ...], start: int, parent: Node | None) -> None:
        self.tokens = tokens
        self.start = start
        self.block_ids: list[int] = []
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access: float = 0
        self.is_protected = False  # in the protected segment (cache/segmented_lru.py)
        self.was_reused = False  # a counted lookup reused it while cached
        self.is_copy = False  # imported KV computed elsewhere, not yet reused by a second lookup here

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def is_attached(self) -> bool:
        """Still in its parent's children (not evicted). Ancestors of an attached
        node are attached: only childless nodes are removed, and a dropped
        namespace detaches every node it held."""
        return self.parent.children.get(self.tokens[0]) is self

    def __repr__(self) -> str:
        return f"Node([{self.start}, {self.end}), blocks={self.block_ids}, lock={self.lock_ref})"


class Root(Node):
    """A namespace's root: an empty edge that holds one permanent lock, so it is
    never an eviction candidate. Knows the namespace it roots."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: SaltKey) -> None:
        super().__init__((), 0, None)
        self.namespace = namespace
        self.lock_ref = 1


def common_prefix_len(edge: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
    """How many leading tokens of ``edge`` equal ``tokens[pos:]``. O(len(edge))."""
    limit = min(len(edge), len(tokens) - pos)
    if tokens[pos : pos + limit] == edge[:limit]:  # C-speed common case
        return limit
    for offset in range(limit):
        if edge[offset] != tokens[pos + offset]:
            return offset
    return limit


def descend(root: Node, key: tuple[int, ...]) -> tuple[list[Node], int, tuple[Node, int] | None]:
    """The tree's one descent along ``key``: (path of wholly matched nodes from
    ``root``, matched length, ``(child, offset)`` if the match stops ``offset``
    tokens into ``child``'s edge). Changes nothing. O(len(key))."""
    node, pos, path = root, 0, [root]
    while pos < len(key):
        child = node.children.get(key[pos])
        if child is None:
            break
        matched = common_prefix_len(child.tokens, key, pos)
        pos += matched
        if matched < len(child.tokens):
            return path, pos, (child, matched)
        path.append(child)
        node = child
    return path, pos, None


def blocks_along(path: list[Node], num_tokens: int, block_size: int) -> tuple[int, ...]:
    """Blocks for positions ``[0, num_tokens)`` along ``path`` (root first): block
    ``j`` from the deepest node covering part of it (it holds the most valid rows)."""
    block_ids: list[int] = []
    for node in path[1:]:
        first = node.start // block_size
        for index in range(first, (min(node.end, num_tokens) - 1) // block_size + 1):
            if index < len(block_ids):
                block_ids[index] = node.block_ids[index - first]
            else:
                block_ids.append(node.block_ids[index - first])
    return tuple(block_ids)


def split(child: Node, offset: int, block_size: int) -> tuple[Node, int | None]:
    """Cut ``child``'s edge after ``offset`` tokens: (the new upper node, the block
    straddling the cut that both halves now name, for the caller to retain, or None)."""
    parent = child.parent
    upper = Node(child.tokens[:offset], child.start, parent)
    upper.lock_ref = child.lock_ref
    upper.last_access = child.last_access
    upper.is_protected = child.is_protected  # the protected positions are the same, split in two
    upper.was_reused = child.was_reused
    upper.is_copy = child.is_copy
    cut = child.start + offset
    shared_block = None
    if child.block_ids:
        first = child.start // block_size
        upper.block_ids = child.block_ids[: (cut - 1) // block_size - first + 1]
        child.block_ids = child.block_ids[cut // block_size - first :]
        if cut % block_size:
            shared_block = child.block_ids[0]
    child.tokens = child.tokens[offset:]
    child.start = cut
    child.parent = upper
    upper.children[child.tokens[0]] = child
    parent.children[upper.tokens[0]] = upper
    return upper, shared_block


def lookup_key(namespace: bytes | None, tokens: tuple[int, ...]) -> int:
    """A position as a lookup names it: the namespace and every token up to and including it."""
    return hash((namespace, tokens))


def ghost_key(node: Node) -> int:
    """:func:`lookup_key` of ``node``'s first position: where a later lookup that
    needs what ``node`` held stops. O(tokens above it)."""
    edges = [node.tokens[:1]]
    parent = node.parent
    while parent.parent is not None:
        edges.append(parent.tokens)
        parent = parent.parent
    return lookup_key(parent.namespace, tuple(itertools.chain.from_iterable(reversed(edges))))


def linked_nodes(root: Node) -> Iterator[Node]:
    """Every node under ``root`` (``root`` itself excluded), each yielded after
    asserting its links: children keyed by their first token, each child's
    ``parent`` and ``start`` consistent with it, and its ``lock_ref`` at least
    its children's (plus one for a root's permanent lock)."""
    stack: list[Node] = [root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for first, child in node.children.items():
            assert child.tokens and child.tokens[0] == first, child
            assert child.parent is node and child.start == node.end, child
            child_locks += child.lock_ref
            stack.append(child)
        assert node.lock_ref >= child_locks + node.is_root, node
        if not node.is_root:
            yield node
