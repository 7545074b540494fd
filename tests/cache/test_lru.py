"""cache.lru.LruQueue: least recently used first, stale entries skipped, bounded size."""

from cache.lru import LruQueue


class Item:
    def __init__(self, name, last_access, evictable=True):
        self.name = name
        self.last_access = last_access
        self.evictable = evictable


def queue():
    return LruQueue(lambda item: item.evictable)


def drain(q):
    out = []
    while (item := q.pop()) is not None:
        out.append(item.name)
    return out


def test_pops_least_recently_used_first_and_ties_by_push_order():
    q = queue()
    for name, access in (("c", 3), ("a", 1), ("b2", 2), ("b1", 2)):
        q.push(Item(name, access))
    assert drain(q) == ["a", "b2", "b1", "c"]
    assert q.pop() is None


def test_touched_items_move_back_and_unevictable_ones_are_skipped():
    q = queue()
    a, b, c = Item("a", 1), Item("b", 2), Item("c", 3)
    for item in (a, b, c):
        q.push(item)
    a.last_access = 4  # touched: its old entry is stale
    q.push(a)
    b.evictable = False  # e.g. locked, or it got a child
    assert q.live_keys() == {(id(c), 3), (id(a), 4)}
    assert drain(q) == ["c", "a"]


def test_an_item_made_evictable_again_needs_a_new_push():
    q = queue()
    a = Item("a", 1)
    q.push(a)
    a.evictable = False
    assert q.pop() is None  # the entry was dropped
    a.evictable = True
    assert q.pop() is None
    q.push(a)
    assert q.pop() is a


def test_stale_entries_are_dropped_so_size_stays_bounded():
    q = queue()
    items = [Item(i, i) for i in range(10)]
    for item in items:
        q.push(item)
    for tick in range(10, 10_000):  # touch the same few items over and over
        item = items[tick % 10]
        item.last_access = tick
        q.push(item)
    assert len(q) <= 2 * 10 + 64 + 1
    assert drain(q) == [items[(9_990 + k) % 10].name for k in range(10)]
