"""Scheduler logic on the real KV cache (allocator + radix tree), no model:
sampled tokens are supplied by the test. Exact chunks, blocks, holds and
preemptions. The scheduler reaches blocks only through ``kv``."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cache.kv_cache import KVCache
from worker.sampling import SamplingParams
from worker.scheduler import Scheduler
from worker.sequence import Sequence, Status

BS = 4


def make(num_blocks=64, budget=64, max_batch_tokens=16, max_num_seqs=4, max_namespaces=1024):
    kv = KVCache(num_blocks, BS, budget, max_namespaces=max_namespaces)
    return Scheduler(kv, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs, eos_token_ids=(1,))


def seq(request_id, tokens, max_new_tokens=3, salt=None):
    return Sequence(request_id, list(tokens), len(tokens), SamplingParams(max_new_tokens=max_new_tokens), salt, 0.0)


def run_step(scheduler, token=7):
    step = scheduler.schedule()
    if step is None:
        return None, []
    num_wanted = sum(c.needs_logits for c in step.chunks)
    sampled = scheduler.complete(step, [token] * num_wanted, [0.0] * num_wanted, 0.0)
    scheduler.check_invariants()
    return step, sampled


def drain(scheduler, token=7, max_steps=1000):
    for _ in range(max_steps):
        if not scheduler.has_work():
            return
        run_step(scheduler, token)
    raise AssertionError("scheduler did not finish")



def test_prefilling_tokens_count_what_a_running_chunked_prefill_has_left():
    """``prefilling_tokens`` (the summary's ``num_prefilling_tokens``): a
    router sees the rest of a long prefill in progress, which
    ``queued_tokens`` (the waiting prompts) stops counting at admission."""
    s = make(max_batch_tokens=8, max_num_seqs=1)
    s.add(seq("a", range(10, 30)))  # 20 tokens
    s.add(seq("b", range(40, 52)))  # 12 tokens, waits: one sequence at a time
    assert (s.queued_tokens(), s.prefilling_tokens()) == (32, 0)
    run_step(s)  # a: 8 of 20
    assert (s.queued_tokens(), s.prefilling_tokens()) == (12, 12)
    run_step(s)  # a: 16 of 20
    assert (s.queued_tokens(), s.prefilling_tokens()) == (12, 4)
    run_step(s)  # a: prefilled, its first token sampled
    assert (s.queued_tokens(), s.prefilling_tokens()) == (12, 0)
    drain(s)
    assert (s.queued_tokens(), s.prefilling_tokens()) == (0, 0)

def test_chunked_prefill_under_the_token_budget_then_decode():
    s = make(max_batch_tokens=8)
    a = seq("a", range(10, 30), max_new_tokens=2)  # 20 tokens
    s.add(a)
    chunks = []
    for _ in range(3):
        step, _ = run_step(s)
        chunks.append([(c.seq.request_id, c.start_pos, c.num_tokens) for c in step.chunks])
    assert chunks == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)]]
    assert a.token_ids[-1] == 7 and a.num_output == 1
    step, sampled = run_step(s)
    assert [(c.start_pos, c.num_tokens) for c in step.chunks] == [(20, 1)]
    assert a.status is Status.FINISHED and a.finish_reason == "length"
    assert s.counters.prefill_tokens == 20 and s.counters.decode_tokens == 1


def test_full_blocks_enter_the_tree_while_prefill_runs():
    s = make(max_batch_tokens=6)
    a = seq("a", range(10, 24))  # 14 tokens
    s.add(a)
    run_step(s)  # computed 6 -> one full block (4) inserted
    assert s.kv.radix.num_tokens == 4 and s.kv.num_cached_tokens("a") == 4
    run_step(s)  # computed 12 -> 3 full blocks
    assert s.kv.radix.num_tokens == 12
    run_step(s)  # prefill done: the whole prompt (partial last block too)
    assert s.kv.radix.num_tokens == 14 and s.kv.num_cached_tokens("a") == 14
    assert s.kv.radix.match(list(range(10, 24)), touch=False).num_tokens == 14


def test_reuse_is_capped_at_len_minus_one_and_counts_a_hit():
    s = make()
    s.add(seq("a", range(10, 22)))
    drain(s)
    b = seq("b", range(10, 22))
    s.add(b)
    step, _ = run_step(s)
    assert [(c.start_pos, c.num_tokens) for c in step.chunks] == [(11, 1)]
    assert b.cached_tokens == 11
    assert s.counters.hits == 1 and s.counters.misses == 1 and s.counters.tokens_saved == 11


def test_partly_matched_block_is_copied_not_shared():
    s = make()
    s.add(seq("a", range(10, 20)))  # 10 tokens: blocks [10..13][14..17][18,19]
    drain(s)
    b = seq("b", [*range(10, 16), 99, 98, 97])  # shares 6 tokens: 1 full block + 2 of the next
    s.add(b)
    step = s.schedule()
    assert b.cached_tokens == 6
    (copy,) = step.copies
    table_a_block1 = s.kv.radix.match(list(range(10, 20)), touch=False).block_ids[1]
    assert copy[0] == table_a_block1 and copy[1] == s.kv.allocator.block_table("b")[1]
    assert s.kv.allocator.block_table("b")[0] == s.kv.radix.match(list(range(10, 20)), touch=False).block_ids[0]


def test_decode_never_writes_a_block_the_tree_holds():
    s = make()
    a = seq("a", range(10, 16), max_new_tokens=4)  # 6 tokens: last block half full
    s.add(a)
    run_step(s)  # prefill: the prompt, partial block included, enters the tree
    shared = s.kv.allocator.block_table("a")[1]
    assert s.kv.allocator.ref_count(shared) == 2
    step, _ = run_step(s)  # first decode must copy that block
    assert step.copies == [(shared, s.kv.allocator.block_table("a")[1])]
    assert s.kv.allocator.block_table("a")[1] != shared


def test_inflight_sharing_holds_back_until_the_prefix_is_cached():
    s = make(max_batch_tokens=32, max_num_seqs=4)
    system = list(range(100, 116))  # 16 tokens = 4 blocks
    a = seq("a", [*system, 1, 2, 3])
    b = seq("b", [*system, 4, 5, 6])
    s.add(a)
    s.add(b)
    step, _ = run_step(s)
    assert [c.seq.request_id for c in step.chunks] == ["a"]  # b waits for a's prefix
    assert s.counters.inflight_holds == 1
    drain(s)
    assert b.cached_tokens == 16
    assert s.counters.prefill_tokens == 19 + 3


def test_in_flight_prefix_tokens_is_what_a_prefilling_or_waiting_sequence_will_cache_beyond_the_cache():
    s = make(max_batch_tokens=8, max_num_seqs=4)
    system = list(range(100, 116))  # 16 tokens = 4 blocks
    a = seq("a", [*system, 1, 2, 3])  # 19 tokens: a 3-step prefill
    s.add(a)
    asked = np.asarray([*system, 1, 2, 3, 9], dtype=np.int64)

    def in_flight(key=asked, salt=None):
        return s.in_flight_prefix_tokens(key, salt, s.kv.radix.match(key.tolist(), salt, touch=False).num_tokens)

    assert in_flight() == 19  # waiting for admission: it will compute its whole prompt
    assert in_flight(salt="t") == 0  # another tenant's
    assert in_flight(asked[:3]) == 0  # shorter than a block: a chance match never counts
    assert in_flight(asked[:17]) == 17  # capped by the asked length, block-aligned or not
    run_step(s)
    assert in_flight() == 19 and s.kv.radix.match(asked.tolist(), touch=False).num_tokens == 8
    run_step(s)
    run_step(s)  # prefill done: the cache holds all 19, a decodes
    assert not a.is_prefilling and in_flight() == 0
    assert s.in_flight_prefix_tokens(asked, None, 0) == 0  # a decoding sequence computes no prefix
    drain(s)
    assert in_flight() == 0


def test_no_hold_for_a_short_chance_match():
    s = make(max_batch_tokens=64)
    s.add(seq("a", [5, 6, 7, 8, 9, 10, 11, 12]))
    s.add(seq("b", [5, 6, 40, 41, 42, 43, 44, 45]))  # shares 2 tokens < one block
    step, _ = run_step(s)
    assert [c.seq.request_id for c in step.chunks] == ["a", "b"]


def test_different_salts_never_share():
    s = make()
    s.add(seq("a", range(10, 22), salt="t1"))
    drain(s)
    b = seq("b", range(10, 22), salt="t2")
    s.add(b)
    drain(s)
    assert b.cached_tokens == 0


def test_a_tenant_past_the_namespace_cap_is_served_uncached_then_cached_once_room_frees():
    s = make(max_batch_tokens=64, max_namespaces=2)
    a = seq("a", range(10, 22), max_new_tokens=5, salt="t1")
    b = seq("b", range(10, 22), max_new_tokens=5, salt="t2")
    s.add(a)
    s.add(b)
    run_step(s)  # both prompts cached in their namespaces, both running: t1 and t2 locked
    assert s.kv.radix.num_namespaces == 2
    c = seq("c", range(40, 48), max_new_tokens=1, salt="t3")
    s.add(c)
    run_step(s)  # admitted and finished, nothing cached for t3, nobody failed
    assert c.status is Status.FINISHED and c.num_output == 1
    assert s.kv.radix.stats.uncached_inserts >= 1 and s.kv.radix.num_namespaces == 2
    drain(s)
    again = seq("c2", range(40, 48), salt="t3")
    s.add(again)
    drain(s)  # t1 (least recently used, unlocked now) evicted whole for t3
    assert again.cached_tokens == 0 and s.kv.num_reusable_tokens(list(range(40, 48)), "t3") == 7
    assert s.kv.radix.stats.evicted_namespaces == 1
    assert s.kv.num_reusable_tokens(list(range(10, 22)), "t1") == 0


def test_preemption_frees_the_youngest_and_recomputes_it():
    s = make(num_blocks=7, budget=6, max_batch_tokens=32, max_num_seqs=4)
    a = seq("a", range(10, 18), max_new_tokens=6)  # 8 tokens = 2 blocks, grows to 14
    b = seq("b", range(40, 48), max_new_tokens=6)
    s.add(a)
    s.add(b)
    drain(s)
    assert s.counters.preemptions >= 1
    assert a.num_output == 6 and b.num_output == 6
    assert a.status is b.status is Status.FINISHED
    s.kv.evict_all()
    assert s.kv.allocator.num_free_blocks == 7


def test_a_preempted_sequence_does_not_protect_its_own_prompt_when_readmitted():
    kv = KVCache(7, BS, 6 * BS, protected_share=0.8)
    s = Scheduler(kv, max_batch_tokens=32, max_num_seqs=4, eos_token_ids=(1,))
    a = seq("a", range(10, 18), max_new_tokens=6)  # distinct prompts: nothing is reused by another request
    b = seq("b", range(40, 48), max_new_tokens=6)
    s.add(a)
    s.add(b)
    drain(s)
    assert s.counters.preemptions >= 1 and s.counters.readmission_tokens_saved > 0
    assert kv.radix.num_protected_tokens == 0  # a readmission's lookup is not a reuse
    assert kv.radix.stats.hits == s.counters.hits == 0


def test_abort_releases_blocks_and_locks():
    s = make()
    a = seq("a", range(10, 30))
    s.add(a)
    run_step(s)
    assert s.abort("a") is a and a.status is Status.FINISHED
    s.check_invariants()
    assert s.abort("a") is None
    s.kv.evict_all()
    assert s.kv.allocator.num_free_blocks == s.kv.allocator.num_blocks


def test_random_workload_keeps_invariants():
    rng = random.Random(3)
    s = make(num_blocks=24, budget=40, max_batch_tokens=12, max_num_seqs=3)
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    live = []
    for index in range(60):
        if rng.random() < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 8))]
            r = seq(f"r{index}", tokens, max_new_tokens=rng.randrange(1, 6))
            s.add(r)
            live.append(r)
        if rng.random() < 0.1 and live:
            s.abort(rng.choice(live).request_id)
            s.check_invariants()
        run_step(s, token=rng.randrange(2, 50))
    drain(s)
    assert all(r.status is Status.FINISHED for r in live)
    s.kv.evict_all()
    assert s.kv.allocator.num_free_blocks == s.kv.allocator.num_blocks
