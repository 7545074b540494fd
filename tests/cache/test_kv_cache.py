"""cache.kv_cache.KVCache: exact blocks, copies, locks and evictions per call, and
a randomized run against a naive model with a simulated KV pool."""

import random

import pytest

from cache.kv_cache import KVCache, Reservation

BS = 4


def make(num_blocks=8, budget=16, watermark=0, **kwargs):
    return KVCache(num_blocks, BS, budget, watermark_blocks=watermark, **kwargs)


def check(kv):
    kv.check_invariants()
    return kv


def served(kv, seq_id, tokens, salt=None):
    """Admit, 'prefill', cache the prompt and finish: the tree keeps it."""
    reserved = kv.admit(seq_id, tokens, salt)
    assert reserved is not None
    kv.finish(seq_id, tokens)
    return check(kv), reserved


# ------------------------------------------------------------------ admit
def test_admit_on_an_empty_cache_takes_fresh_blocks_in_order():
    kv = make()
    assert kv.admit("a", list(range(10)), None) == Reservation(0, None)
    assert kv.block_table("a") == [0, 1, 2] and kv.num_free_blocks == 5
    assert kv.num_reserved_tokens("a") == 10 and kv.num_cached_tokens("a") == 0
    assert kv.radix.num_locks == 1 and (kv.radix.stats.hits, kv.radix.stats.misses) == (0, 1)
    check(kv)


def test_reuse_stops_one_short_and_copies_the_partly_matched_block():
    kv, _ = served(make(), "a", list(range(10)))  # blocks 0, 1, 2 now belong to the tree
    assert kv.num_free_blocks == 5
    # same prompt: reuse 9 of 10; block 2 holds 1 matched row (position 8): copied into fresh block 3
    assert kv.admit("b", list(range(10)), None) == Reservation(9, (2, 3))
    assert kv.block_table("b") == [0, 1, 3]
    assert [kv.allocator.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert kv.num_cached_tokens("b") == 9 and kv.radix.stats.tokens_saved == 9
    # a prompt ending on a block boundary shares every matched block: no copy
    assert kv.admit("c", list(range(8)) + [50], None) == Reservation(8, None)
    assert kv.block_table("c") == [0, 1, 4]
    check(kv)


def test_salts_never_share():
    kv, _ = served(make(), "a", list(range(10)), salt="t1")
    assert kv.num_reusable_tokens(list(range(10)), "t1") == 9
    assert kv.admit("b", list(range(10)), "t2") == Reservation(0, None)
    assert kv.admit("c", list(range(10)), None).num_cached_tokens == 0
    check(kv)


def test_admission_evicts_lru_unlocked_entries_for_its_blocks_and_the_watermark():
    kv = make(num_blocks=6, budget=24, watermark=1)
    served(kv, "a", [1] * 8)  # blocks 0, 1 in the tree
    served(kv, "b", [2] * 8)  # blocks 2, 3
    assert kv.num_free_blocks == 2
    # 8 fresh-prompt tokens: 2 blocks + 1 watermark > 2 free: the LRU entry ("a") goes
    assert kv.admit("c", [3] * 8, None) == Reservation(0, None)
    assert kv.block_table("c") == [4, 5] and kv.radix.stats.evicted_tokens == 8
    assert kv.num_reusable_tokens([1] * 9, None) == 0 and kv.num_reusable_tokens([2] * 9, None) == 8
    check(kv)


def test_admission_that_does_not_fit_changes_nothing():
    kv = make(num_blocks=6, budget=24)
    served(kv, "a", [1] * 8)
    assert kv.admit("b", [1] * 8 + [5] * 4, None) is not None  # locks a's path, 1 fresh block
    before = (kv.num_free_blocks, kv.radix.num_tokens, kv.radix.num_locks, kv.radix.stats)
    assert kv.admit("c", [7] * 20, None) is None  # 5 blocks: 3 free and a's 2 are locked by b
    assert (kv.num_free_blocks, kv.radix.num_tokens, kv.radix.num_locks, kv.radix.stats) == before
    assert "c" not in kv and len(kv) == 1
    check(kv)


# ------------------------------------------------------------------ append
def test_append_copies_a_shared_last_block_once_then_writes_in_place():
    kv = make()
    kv.admit("a", [1, 2, 3, 4, 5, 6], None)  # blocks 0, 1
    kv.cache("a", [1, 2, 3, 4, 5, 6])  # the prefill ends: the tree holds both, block 1 partly filled
    assert kv.allocator.ref_count(1) == 2
    assert kv.append("a") == Reservation(0, (1, 2))  # position 6 goes to a private copy of block 1
    assert kv.block_table("a") == [0, 2] and kv.allocator.ref_count(1) == 1
    assert kv.append("a") == Reservation(0, None)  # position 7: in place
    assert kv.append("a") == Reservation(0, None) and kv.block_table("a") == [0, 2, 3]  # position 8: a new block
    check(kv)


def test_append_evicts_for_a_block_then_reports_none():
    kv = make(num_blocks=3, budget=8)
    served(kv, "old", [9] * 4)  # block 0 held by the tree alone
    kv.admit("a", [1] * 8, None)  # blocks 1, 2: the pool is full
    assert kv.append("a") == Reservation(0, None)  # "old" evicted, block 0 reused
    assert kv.block_table("a") == [1, 2, 0] and kv.radix.num_tokens == 0
    for _ in range(3):
        assert kv.append("a") is not None  # fills block 0
    assert kv.append("a") is None  # nothing left to evict
    assert kv.num_reserved_tokens("a") == 12
    check(kv)


# ------------------------------------------------------------------ cache, finish, release
def test_cache_moves_the_lock_down_the_path_and_ignores_what_it_cached():
    kv = make(budget=16)
    prompt = list(range(12))
    kv.admit("a", prompt, None)
    kv.cache("a", prompt[:4])
    assert kv.num_cached_tokens("a") == 4 and kv.radix.num_locked_tokens == 4
    kv.cache("a", prompt[:4])  # nothing new
    kv.cache("a", prompt[:8])
    assert kv.num_cached_tokens("a") == 8 and kv.radix.num_locked_tokens == 8 and kv.radix.num_locks == 1
    assert kv.evict_all() == 0  # the whole cached path is locked
    kv.release("a")
    assert kv.radix.num_locks == 0 and kv.num_free_blocks == 6  # the tree keeps blocks 0, 1
    assert kv.evict_all() == 8 and kv.num_free_blocks == 8
    check(kv)


def test_a_sequence_admitted_over_the_budget_is_never_cached():
    kv = make(budget=8)
    served(kv, "a", [5] * 4)
    kv.admit("b", list(range(12)), None)
    kv.finish("b", list(range(12)))
    assert kv.radix.num_tokens == 4 and kv.num_reusable_tokens([5] * 5, None) == 4  # "a" was not flushed
    check(kv)


def test_finish_caches_prompt_and_output_for_the_next_turn():
    kv = make(budget=16)
    kv.admit("turn1", [1, 2, 3, 4, 5], None)
    kv.cache("turn1", [1, 2, 3, 4, 5])
    kv.append("turn1")  # the sampled token's position
    kv.finish("turn1", [1, 2, 3, 4, 5, 6])
    assert kv.admit("turn2", [1, 2, 3, 4, 5, 6, 7, 8], None).num_cached_tokens == 6
    check(kv)


def test_release_of_a_preempted_sequence_keeps_what_it_cached():
    kv = make()
    kv.admit("a", list(range(8)), None)
    kv.cache("a", list(range(8)))
    kv.release("a")
    assert "a" not in kv and kv.radix.num_tokens == 8 and kv.num_free_blocks == 6
    assert kv.admit("a", list(range(8)) + [9], None) == Reservation(8, None)  # recomputed from the cache
    check(kv)


def test_a_readmitted_sequence_neither_counts_nor_protects_its_own_prefix():
    kv = make(protected_share=0.5)
    kv.admit("a", list(range(8)), None)
    kv.cache("a", list(range(8)))
    kv.release("a")  # preempted: what it cached stays
    hits, misses = kv.radix.stats.hits, kv.radix.stats.misses
    assert kv.admit("a", list(range(8)) + [9], None, is_readmission=True) == Reservation(8, None)
    assert (kv.radix.stats.hits, kv.radix.stats.misses) == (hits, misses)
    assert kv.radix.num_protected_tokens == 0  # its own work, reused by nobody else
    kv.finish("a", list(range(8)) + [9])
    assert kv.admit("b", list(range(8)) + [5], None).num_cached_tokens == 8  # another request's reuse
    assert kv.radix.stats.hits == hits + 1 and kv.radix.num_protected_tokens == 8
    check(kv)


def test_misuse_raises():
    kv = make()
    kv.admit("a", [1, 2, 3], None)
    with pytest.raises(ValueError, match="already admitted"):
        kv.admit("a", [1], None)
    with pytest.raises(ValueError, match="at least one token"):
        kv.admit("b", [], None)
    with pytest.raises(KeyError, match="unknown sequence id 'x'"):
        kv.release("x")
    with pytest.raises(ValueError, match="4 tokens to cache, 'a' has 3"):
        kv.cache("a", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="watermark_blocks"):
        KVCache(4, BS, 8, watermark_blocks=5)
    check(kv)


# ------------------------------------------------------------------ randomized vs a naive model
class NaiveKV:
    """What a KV cache must show: with the budget and pool large enough never
    to evict, reuse is the longest prefix (<= len - 1) of a cached sequence of
    the same salt; with a small pool, eviction can only make it shorter."""

    def __init__(self):
        self.cached = set()  # (salt, prefix) for every prefix of every cached sequence

    def reuse(self, tokens, salt):
        k = len(tokens) - 1
        while k and (salt, tuple(tokens[:k])) not in self.cached:
            k -= 1
        return k

    def cache(self, tokens, salt):
        for k in range(1, len(tokens) + 1):
            self.cached.add((salt, tuple(tokens[:k])))


class Driver:
    """Drives a KVCache like an engine, with a simulated KV pool (block -> rows)."""

    def __init__(self, kv, rng):
        self.kv, self.rng = kv, rng
        self.pool = {b: [None] * BS for b in range(kv.num_blocks)}
        self.naive = NaiveKV()
        self.seqs = {}  # seq_id -> (salt, tokens, num_written, admitted length)
        self.next_id = 0

    def write(self, seq_id, pos, token):
        block_id = self.kv.block_table(seq_id)[pos // BS]
        assert self.kv.allocator.ref_count(block_id) == 1, f"write into shared block {block_id}"
        self.pool[block_id][pos % BS] = token

    def apply(self, reserved):
        if reserved.copy is not None:
            src, dst = reserved.copy
            self.pool[dst] = list(self.pool[src])

    def admit(self, tokens, salt, exact):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        expected = self.naive.reuse(tokens, salt)
        before = (self.kv.num_free_blocks, self.kv.radix.num_locks)
        reserved = self.kv.admit(seq_id, tokens, salt)
        if reserved is None:
            assert seq_id not in self.kv and self.kv.radix.num_locks == before[1]
            return
        assert reserved.num_cached_tokens == expected if exact else reserved.num_cached_tokens <= expected
        self.apply(reserved)
        for pos in range(reserved.num_cached_tokens):  # reused rows hold the prompt's tokens
            assert self.pool[self.kv.block_table(seq_id)[pos // BS]][pos % BS] == tokens[pos]
        for pos in range(reserved.num_cached_tokens, len(tokens)):
            self.write(seq_id, pos, tokens[pos])
        self.seqs[seq_id] = (salt, list(tokens), len(tokens))

    def step(self, exact):
        rng = self.rng
        op = rng.random()
        if op < 0.4 or not self.seqs:
            base = rng.choice([t for _, t, _ in self.seqs.values()] or [[]]) if rng.random() < 0.6 else []
            tokens = base[: rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(1, 10))]
            self.admit(tokens, rng.choice([None, "a"]), exact)
            return
        seq_id = rng.choice(sorted(self.seqs))
        salt, tokens, admitted = self.seqs[seq_id]
        if op < 0.65:
            reserved = self.kv.append(seq_id)
            if reserved is not None:
                self.apply(reserved)
                token = rng.randrange(4)
                self.write(seq_id, len(tokens), token)
                tokens.append(token)
        elif op < 0.8:
            prefix = tokens[: rng.randint(0, len(tokens))]
            self.kv.cache(seq_id, prefix)
            if admitted <= self.kv.radix.budget_tokens:
                self.naive.cache(prefix, salt)
        elif op < 0.93:
            self.kv.finish(seq_id, tokens)
            if admitted <= self.kv.radix.budget_tokens:
                self.naive.cache(tokens, salt)
            del self.seqs[seq_id]
        else:
            self.kv.release(seq_id)
            del self.seqs[seq_id]
        for seq_id, (_, tokens, _) in self.seqs.items():  # every sequence reads its own tokens
            table = self.kv.block_table(seq_id)
            assert all(self.pool[table[p // BS]][p % BS] == tokens[p] for p in range(len(tokens)))

    def drain(self):
        for seq_id in list(self.seqs):
            self.kv.release(seq_id)
        self.kv.evict_all()
        assert self.kv.num_free_blocks == self.kv.num_blocks and self.kv.radix.num_locks == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_calls_match_the_naive_model_when_nothing_is_evicted(seed):
    driver = Driver(make(num_blocks=600, budget=100_000, watermark=2), random.Random(seed))
    for _ in range(300):
        driver.step(exact=True)
        driver.kv.check_invariants()
    assert driver.kv.radix.stats.evictions == 0 and driver.kv.radix.stats.hits > 10
    driver.drain()


@pytest.mark.parametrize("seed", range(6))
def test_random_calls_under_a_small_pool_stay_correct(seed):
    driver = Driver(make(num_blocks=14, budget=24, watermark=1), random.Random(100 + seed))
    for _ in range(300):
        driver.step(exact=False)
        driver.kv.check_invariants()
    assert driver.kv.radix.stats.evictions > 0
    driver.drain()


# --------------------------------------------------------- imported prefixes
def test_reserve_import_reuses_the_whole_match_and_copies_a_partial_block():
    kv = make()
    served(kv, "a", [1, 2, 3, 4, 5, 6])  # blocks 0, 1 (2 rows)
    hits = kv.radix.stats.hits
    reserved = kv.reserve_import("i", [1, 2, 3, 4, 5, 6, 7, 8, 9], None)
    assert reserved == Reservation(6, (1, 2))  # all 6 reused (not len - 1): block 1 copied into 2
    assert kv.block_table("i") == [0, 2, 3] and kv.radix.stats.hits == hits  # a pure read
    assert kv.finish("i", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 3
    assert kv.radix.match([1, 2, 3, 4, 5, 6, 7, 8, 9], touch=False).block_ids == (0, 2, 3)
    check(kv)


def test_reserve_import_without_room_changes_nothing_and_release_undoes_it():
    kv = make(num_blocks=4, budget=16)
    kv.admit("r", list(range(100, 112)), None)  # 3 of 4 blocks
    assert kv.reserve_import("i", [1, 2, 3, 4, 5, 6], None) is None
    assert kv.num_free_blocks == 1 and kv.radix.num_locks == 1
    kv.release("r")
    assert kv.reserve_import("i", [1, 2, 3, 4, 5, 6], None) == Reservation(0, None)
    kv.release("i")  # a failed write: nothing kept
    assert kv.num_free_blocks == 4 and kv.radix.num_tokens == 0
    check(kv)


def test_pinned_prefix_locks_while_inside_and_is_a_pure_read():
    kv = make()
    served(kv, "a", [1, 2, 3, 4, 5, 6])
    with kv.pinned_prefix([1, 2, 3, 4, 5, 9], None) as match:
        assert (match.num_tokens, match.block_ids) == (5, (0, 1))
        assert kv.radix.num_locked_tokens == 6 and kv.evict_all() == 0
    assert kv.radix.num_locks == 0
    check(kv)
