"""RadixCache + BlockAllocator against a naive reference model (hypothesis state machine).

A fake engine drives a real-mode RadixCache over a real BlockAllocator, with a
simulated-mode RadixCache and a naive model fed the same operations. The KV
pool is simulated as ``block id -> [token or None] * block_size``: the engine
writes a sequence's tokens into its blocks (and copies rows on copy-on-write),
so the test can check that every block a match returns really holds the
matched tokens at the right rows, that every live sequence still reads its own
tokens, and that no write ever lands in a block someone else holds.

The naive model (tests/cache/naive_radix.py) does everything by brute force.
"""

import copy
import dataclasses

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache import BlockAllocator, OutOfBlocks, RadixCache
from cache.segmented_lru import SERVING_PROTECTED_SHARE
from tests.cache.naive_radix import NaiveRadix, namespace

SALTS = [None, "a", b"a", "b", "c"]  # "a" and b"a" are one namespace


class Seq:
    def __init__(self, tokens, salt):
        self.tokens = list(tokens)
        self.salt = salt
        self.lock = None  # (real node, simulated node, naive key)


token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=13)


class CacheMachine(RuleBasedStateMachine):
    BLOCK_SIZE = 4
    NUM_BLOCKS = 40
    BUDGET_TOKENS = 30
    MAX_NAMESPACES = 1024
    PROTECTED_SHARE = 0.0  # plain LRU

    def __init__(self):
        super().__init__()
        bs, share = self.BLOCK_SIZE, self.PROTECTED_SHARE
        self.alloc = BlockAllocator(self.NUM_BLOCKS, bs)
        self.radix = RadixCache(self.BUDGET_TOKENS, bs, self.alloc, max_namespaces=self.MAX_NAMESPACES,
                                protected_share=share)
        self.sim = RadixCache(self.BUDGET_TOKENS, bs, max_namespaces=self.MAX_NAMESPACES, protected_share=share)
        self.naive = NaiveRadix(self.BUDGET_TOKENS, self.MAX_NAMESPACES, share)
        self.kv = {b: [None] * bs for b in range(self.NUM_BLOCKS)}
        self.seqs = {}
        self.next_seq_id = 0
        self.inserted = []  # (salt, tokens) of every insert: every cached position lies on one
        self.locks = []  # (real node, simulated node, naive key) held outside any sequence

    # -- the fake engine
    def write(self, seq_id, pos, token):
        block_id = self.alloc.block_table(seq_id)[pos // self.BLOCK_SIZE]
        assert self.alloc.ref_count(block_id) == 1, f"write into shared block {block_id}"
        assert self.alloc.retained_count(block_id) == 0, f"write into tree-held block {block_id}"
        self.kv[block_id][pos % self.BLOCK_SIZE] = token

    def copy_block(self, pair):
        if pair is not None:
            src, dst = pair
            self.kv[dst] = list(self.kv[src])

    def check_blocks_hold(self, block_ids, tokens):
        bs = self.BLOCK_SIZE
        assert len(block_ids) == -(-len(tokens) // bs)
        for pos, token in enumerate(tokens):
            assert self.kv[block_ids[pos // bs]][pos % bs] == token, (pos, block_ids, tokens)

    def all_match(self, tokens, salt, touch=True):
        real = self.radix.match(tokens, salt, touch=touch)
        sim = self.sim.match(tokens, salt, touch=touch)
        num_naive, key = self.naive.match(tokens, salt, touch=touch)
        assert real.num_tokens == sim.num_tokens == num_naive, (tokens, salt)
        self.check_blocks_hold(real.block_ids, tokens[: real.num_tokens])
        return real, sim, key

    def lock_all(self, held, delta):
        real, sim, key = held
        if delta > 0:
            self.radix.lock(real)
            self.sim.lock(sim)
        else:
            self.radix.unlock(real)
            self.sim.unlock(sim)
        self.naive.lock(key, delta)

    def draw_tokens(self, data):
        fresh = data.draw(token_lists)
        if self.inserted and data.draw(st.booleans()):
            _, base = self.inserted[data.draw(st.integers(0, len(self.inserted) - 1))]
            cut = data.draw(st.integers(0, len(base)))
            fresh = (base[:cut] + fresh)[:16]
        return fresh

    def begin(self, tokens, salt, lock):
        """Admit a request: reuse its cached prefix (at most all but one token), write the rest."""
        real, sim, key = self.all_match(tokens, salt)
        num_reused = min(real.num_tokens, len(tokens) - 1)
        prefix = real.block_ids[: -(-num_reused // self.BLOCK_SIZE)]
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        before = copy.deepcopy(vars(self.alloc))
        try:
            copy_pair = self.alloc.allocate_with_prefix(seq_id, len(tokens), prefix, num_reused)
        except OutOfBlocks:
            assert vars(self.alloc) == before
            event("start: out of blocks")
            return None
        event(f"start: reused {'some' if num_reused else 'none'}, copied {'a block' if copy_pair else 'nothing'}")
        self.copy_block(copy_pair)
        for pos in range(num_reused, len(tokens)):
            self.write(seq_id, pos, tokens[pos])
        seq = self.seqs[seq_id] = Seq(tokens, salt)
        if lock:
            seq.lock = (real, sim, key)
            self.lock_all(seq.lock, +1)
        return seq_id

    def decode(self, seq_id, token):
        seq = self.seqs[seq_id]
        before = copy.deepcopy(vars(self.alloc))
        try:
            copy_pair = self.alloc.append(seq_id)
        except OutOfBlocks:
            assert vars(self.alloc) == before
            event("append: out of blocks")
            return
        event(f"append: {'copy-on-write' if copy_pair else 'in place'}")
        self.copy_block(copy_pair)
        self.write(seq_id, len(seq.tokens), token)
        seq.tokens.append(token)

    def end(self, seq_id, num_cached):
        """Finish a request: cache its first ``num_cached`` tokens (none if None), unlock, free."""
        seq = self.seqs.pop(seq_id)
        if num_cached is not None:
            tokens = seq.tokens[:num_cached]
            num_new = self.radix.insert(tokens, self.alloc.block_table(seq_id), seq.salt)
            assert num_new == self.sim.insert(tokens, salt=seq.salt) == self.naive.insert(tokens, seq.salt)
            if num_new:
                event("insert: new")
            elif self.radix.match(tokens, seq.salt, touch=False).num_tokens == len(tokens):
                event("insert: already cached")
            else:
                event("insert: no room")
            if num_new:
                self.inserted.append((seq.salt, tokens))
        if seq.lock is not None:
            self.lock_all(seq.lock, -1)
        self.alloc.free(seq_id)

    # -- rules
    # -- rules
    @rule(data=st.data(), salt=st.sampled_from(SALTS), lock=st.booleans())
    def start(self, data, salt, lock):
        self.begin(self.draw_tokens(data), salt, lock)

    @rule(data=st.data(), salt=st.sampled_from(SALTS), new_tokens=st.lists(st.integers(0, 2), max_size=6))
    def request(self, data, salt, new_tokens):
        """A whole request: admit, decode a few tokens, cache prompt + output."""
        seq_id = self.begin(self.draw_tokens(data), salt, lock=True)
        if seq_id is not None:
            for token in new_tokens:
                self.decode(seq_id, token)
            self.end(seq_id, len(self.seqs[seq_id].tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        self.decode(data.draw(st.sampled_from(sorted(self.seqs))), token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent_id = data.draw(st.sampled_from(sorted(self.seqs)))
        child_id = self.next_seq_id
        self.next_seq_id += 1
        self.alloc.fork(parent_id, child_id)
        parent = self.seqs[parent_id]
        self.seqs[child_id] = Seq(parent.tokens, parent.salt)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data, insert):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        # cache the whole sequence, or a prefix (the prompt), or nothing
        num_cached = data.draw(st.integers(0, len(self.seqs[seq_id].tokens))) if insert else None
        self.end(seq_id, num_cached)

    @rule(data=st.data(), salt=st.sampled_from(SALTS), touch=st.booleans())
    def lookup(self, data, salt, touch):
        self.all_match(self.draw_tokens(data), salt, touch=touch)

    @rule(data=st.data(), salt=st.sampled_from(SALTS))
    def lock(self, data, salt):
        held = self.all_match(self.draw_tokens(data), salt)
        self.lock_all(held, +1)
        self.locks.append(held)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        held = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.lock_all(held, -1)

    @rule(num_tokens=st.integers(0, 20))
    def evict(self, num_tokens):
        removed = self.radix.evict(num_tokens)
        assert removed == self.sim.evict(num_tokens) == self.naive.evict(num_tokens)
        event(f"evict: removed {'some' if removed else 'none'}")

    # -- checks after every step
    @invariant()
    def namespaces_agree(self):
        self.naive.prune()
        assert self.radix.num_namespaces == self.sim.num_namespaces == len(self.naive.live) <= self.MAX_NAMESPACES
        assert [e.namespace for e in self.radix.edges() if e.depth == 0] == [
            e.namespace for e in self.sim.edges() if e.depth == 0]
        if self.radix.stats.evicted_namespaces:
            event("state: a namespace was evicted at the cap")
        if self.radix.stats.uncached_inserts:
            event("state: a new namespace was served uncached")

    @invariant()
    def structures_are_consistent(self):
        self.radix.check_invariants()
        self.sim.check_invariants()
        self.alloc.check_invariants()

    @invariant()
    def real_simulated_and_naive_agree(self):
        assert self.radix.num_tokens == self.sim.num_tokens == self.naive.num_tokens <= self.BUDGET_TOKENS
        assert self.radix.stats == self.sim.stats
        real_stats = dataclasses.asdict(self.radix.stats)
        assert real_stats == {name: self.naive.stats[name] for name in real_stats}
        # the same positions are cached: probe every inserted sequence (a pure read)
        for salt, tokens in self.inserted:
            real = self.radix.match(tokens, salt, touch=False)
            ns = namespace(salt)
            assert real.num_tokens == self.sim.match(tokens, salt, touch=False).num_tokens
            assert real.num_tokens == self.naive.cached_len(ns, tokens)
            self.check_blocks_hold(real.block_ids, tokens[: real.num_tokens])

    @invariant()
    def locked_paths_stay_cached(self):
        held = self.locks + [s.lock for s in self.seqs.values() if s.lock is not None]
        for _, _, key in held:
            if key is not None:
                ns, end = key
                salt = None if ns is None else ns
                assert self.radix.match(list(end), salt, touch=False).num_tokens == len(end)
        if self.radix.num_locked_tokens:
            event("state: some positions locked")
        if self.radix.stats.evictions:
            event("state: LRU evicted")
        assert self.radix.num_locked_tokens == len({p for p in self.naive.access if self.naive.is_pinned(*p)})
        assert self.radix.num_protected_tokens == self.sim.num_protected_tokens == len(self.naive.protected)
        if self.radix.num_protected_tokens:
            event("state: some positions protected")

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, seq in self.seqs.items():
            assert self.alloc.num_tokens(seq_id) == len(seq.tokens)
            self.check_blocks_hold(self.alloc.block_table(seq_id), seq.tokens)

    def teardown(self):
        # nothing leaks: with every lock and sequence gone the tree empties and every block is free
        for held in self.locks:
            self.lock_all(held, -1)
        for seq_id, seq in self.seqs.items():
            if seq.lock is not None:
                self.lock_all(seq.lock, -1)
            self.alloc.free(seq_id)
        assert self.radix.num_locked_tokens == 0
        self.radix.clear()
        assert self.radix.num_tokens == 0 and self.radix.num_namespaces == 0
        assert self.alloc.num_free_blocks == self.NUM_BLOCKS
        self.radix.check_invariants()
        self.alloc.check_invariants()


class CacheMachineBlockSize3(CacheMachine):
    BLOCK_SIZE = 3
    NUM_BLOCKS = 30
    BUDGET_TOKENS = 24


class CacheMachineBlockSize1(CacheMachine):
    BLOCK_SIZE = 1
    NUM_BLOCKS = 60
    BUDGET_TOKENS = 20


class CacheMachineTwoNamespaces(CacheMachine):
    """Four salts against a cap of two: namespaces evicted whole, or new ones served uncached."""

    MAX_NAMESPACES = 2


class CacheMachineSegmented(CacheMachine):
    """Segmented LRU with a third of the budget protected: demotions happen often."""

    PROTECTED_SHARE = 1 / 3


class CacheMachineSegmentedBlockSize1(CacheMachineBlockSize1):
    """Segmented LRU as the engine runs it (SERVING_PROTECTED_SHARE) at one position per block."""

    PROTECTED_SHARE = SERVING_PROTECTED_SHARE




def _test_case(machine):
    case = machine.TestCase
    case.settings = settings(
        max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    return case


TestCacheMachine = _test_case(CacheMachine)
TestCacheMachineBlockSize3 = _test_case(CacheMachineBlockSize3)
TestCacheMachineBlockSize1 = _test_case(CacheMachineBlockSize1)
TestCacheMachineTwoNamespaces = _test_case(CacheMachineTwoNamespaces)
TestCacheMachineSegmented = _test_case(CacheMachineSegmented)
TestCacheMachineSegmentedBlockSize1 = _test_case(CacheMachineSegmentedBlockSize1)
