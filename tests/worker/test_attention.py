"""Both kernels against plain causal attention over each sequence's full context."""

import pytest
import torch

from worker.attention import DECODE_KEY_CHUNK, paged_attention
from worker.kv import KVPool
from worker.model import KVGeometry
from worker.step import SeqChunk, build_step
from worker.tiled_attention import choose_share_rows, choose_tile_rows, small_tile_rows, tile_rows_are_exact

GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=2, head_dim=8, num_heads=4)


class Layer:
    layer_idx = 0


def naive(q_all, k_all, v_all, scale):
    """q [heads, n, D] at positions ctx-n..ctx-1; k, v [kv_heads, ctx, D] -> [n, heads, D]."""
    heads, n, _ = q_all.shape
    ctx = k_all.shape[1]
    k = k_all.repeat_interleave(heads // k_all.shape[0], dim=0)
    v = v_all.repeat_interleave(heads // v_all.shape[0], dim=0)
    scores = (q_all.double() @ k.double().transpose(1, 2)) * scale
    positions = torch.arange(ctx - n, ctx)
    scores = scores.masked_fill(torch.arange(ctx)[None, None, :] > positions[None, :, None], float("-inf"))
    return (torch.softmax(scores, -1) @ v.double()).transpose(0, 1).float()


def run(chunk_specs, deterministic, tile_rows=(16, 16), block_size=4, scratch_tokens=32768, num_blocks=64,
        share_rows=0, plans=None, native=False, keys_of=None):
    """chunk_specs: (start, n, table) or (start, n, table, q_seed) per sequence. A sequence's
    q, k, v depend only on its own spec (seeded by it), so the same sequence in two batches
    sees equal inputs; with a q_seed, q is drawn from it instead (k, v still from (start, n):
    sequences of one (start, n) may then share blocks). Keys of positions before ``start``
    are written into the pool first. ``plans``: a list the step's plan is appended to.
    ``keys_of``: (start, n) seeding every sequence's q, k, v instead of its own (sequences then
    hold the same context: one context, several chunkings)."""
    pool = KVPool(GEOMETRY, num_blocks=num_blocks, block_size=block_size, dtype=torch.float32, device=torch.device("cpu"))
    data = []
    for start, length, table, *q_seed in chunk_specs:
        generator = torch.Generator().manual_seed(start * 1000 + length)
        q = torch.randn(4, length, 8, generator=generator)
        k = torch.randn(2, start + length, 8, generator=generator)
        v = torch.randn(2, start + length, 8, generator=generator)
        if keys_of is not None:
            context = torch.Generator().manual_seed(keys_of[0] * 1000 + keys_of[1])
            k_all, v_all = torch.randn(2, sum(keys_of), 8, generator=context), torch.randn(2, sum(keys_of), 8, generator=context)
            q_all = torch.randn(4, sum(keys_of), 8, generator=context)
            q, k, v = q_all[:, start : start + length], k_all[:, : start + length], v_all[:, : start + length]
        if q_seed:
            q = torch.randn(4, length, 8, generator=torch.Generator().manual_seed(q_seed[0]))
        data.append((q, k, v))
        for pos in range(start):
            block, offset = table[pos // block_size], pos % block_size
            pool.data[0, 0, :, block, offset] = k[:, pos]
            pool.data[0, 1, :, block, offset] = v[:, pos]
    chunks = [SeqChunk([5] * n, s, t, True) for s, n, t, *_ in chunk_specs]
    step = build_step(
        chunks, pool, deterministic=deterministic, pad_token_id=0, num_heads=4, tile_rows=tile_rows,
        scratch_tokens=scratch_tokens, share_rows=share_rows, native=native,
    )
    if plans is not None:
        plans.append(step.plan)
    rows = step.input_ids.shape[0]
    query, key, value = torch.zeros(1, 4, rows, 8), torch.zeros(1, 2, rows, 8), torch.zeros(1, 2, rows, 8)
    offset = 0
    for (start, length, *_), (q, k, v) in zip(chunk_specs, data):
        query[0, :, offset : offset + length] = q
        key[0, :, offset : offset + length] = k[:, start:]
        value[0, :, offset : offset + length] = v[:, start:]
        offset += length
    out, _ = paged_attention(Layer(), query, key, value, None, scaling=0.3, kvroute_step=step)
    expected = torch.cat([naive(q, k, v, 0.3) for q, k, v in data])
    return out[0, : step.num_tokens], expected


SPECS = [(0, 9, [0, 1, 2]), (37, 1, list(range(3, 13))), (5, 6, [13, 14, 15]), (70, 1, list(range(16, 34))), (0, 1, [34])]


@pytest.mark.parametrize("deterministic", [False, True])
def test_kernels_compute_causal_attention_over_each_sequences_blocks(deterministic):
    out, expected = run(SPECS, deterministic)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_size", [2, 4, 32, 64])
def test_tiled_kernel_with_small_decode_tiles_and_any_block_size(block_size):
    specs = [(0, 9, list(range(0, 5))), (37, 1, list(range(5, 25))), (70, 1, list(range(25, 62)))]
    if block_size >= 32:
        specs = [(0, 9, [0]), (37, 1, [1, 2]), (70, 1, [3, 4, 5])]
    for tile_rows in ((4, 128), (4, 16), (16, 16)):
        out, expected = run(specs, True, tile_rows=tile_rows, block_size=block_size)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tile_rows", [(4, 128), (4, 16), (16, 16)])
def test_tiled_kernel_gives_a_query_the_same_bits_in_any_batch(tile_rows):
    mixed, _ = run(SPECS, True, tile_rows=tile_rows)
    offsets = [0, 9, 10, 16, 17]
    for index, spec in enumerate(SPECS):
        alone, _ = run([spec], True, tile_rows=tile_rows)
        assert torch.equal(alone, mixed[offsets[index] : offsets[index] + spec[1]]), index
    reordered, _ = run(SPECS[::-1], True, tile_rows=tile_rows)
    assert torch.equal(reordered[:1], mixed[17:18])


def test_tile_sizes_do_not_change_a_single_bit_where_the_probe_passes():
    assert tile_rows_are_exact((4, 16, 128), 8, 64, torch.float32, torch.device("cpu"))
    results = [run(SPECS, True, tile_rows=rows)[0] for rows in ((4, 128), (4, 16), (16, 16), (16, 128))]
    assert all(torch.equal(r, results[0]) for r in results)


def test_small_tile_probe():
    assert small_tile_rows(1) == 4 and small_tile_rows(4) == 4 and small_tile_rows(7) == 7 and small_tile_rows(32) == 16
    assert choose_tile_rows(2, 8, torch.float32, torch.device("cpu")) == (4, 128)


def _tables(specs, block_size):
    """(start, n) per sequence → (start, n, a block table of fresh blocks, in reverse order)."""
    out, next_block = [], 0
    for start, length in specs:
        num_blocks = -(-(start + length) // block_size)
        out.append((start, length, list(range(next_block + num_blocks - 1, next_block - 1, -1))))
        next_block += num_blocks
    return out, next_block


# Contexts ending on, just before and just past block and key-chunk boundaries, decodes and prefills mixed.
EDGES = [(0, 1), (3, 1), (4, 1), (127, 1), (128, 1), (129, 1), (255, 1), (300, 1), (0, 16), (4, 4), (125, 7), (250, 30)]


@pytest.mark.parametrize("scratch_tokens", [1, 128, 256, 32768])
@pytest.mark.parametrize("block_size", [4, 16])
def test_default_kernel_reads_blocks_in_place_at_mixed_lengths_and_boundaries(scratch_tokens, block_size):
    """Against dense attention over each sequence's whole context; a small scratch budget
    splits the work into many rounds (one key chunk each at the smallest)."""
    specs, num_blocks = _tables(EDGES, block_size)
    out, expected = run(specs, False, block_size=block_size, scratch_tokens=scratch_tokens, num_blocks=num_blocks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("in_place", [False, True])
def test_default_plan_never_gathers_more_than_its_scratch_budget(in_place):
    """Scratch bound: every round gathers at most ``scratch_tokens`` positions (one key chunk
    at least), whatever the batch and its contexts; decodes read no key chunk past their end.
    In place (consecutive tables), nothing is gathered: every position is read from the pool."""
    from worker.attention import build_default_plan
    from worker.chunk_arrays import ChunkArrays
    from worker.default_plan import MIN_IN_PLACE_TOKENS, NEVER_IN_PLACE
    import numpy as np

    block_size, scratch = 16, 512
    for num_seqs, context in ((1, 8192), (64, 512), (64, 8192)):
        lengths = np.ones(num_seqs, dtype=np.int64)
        lengths[0] = 100  # one prefill chunk beside the decodes
        starts = np.full(num_seqs, context - 1, dtype=np.int64)
        num_table = -(-context // block_size) + 7
        tables = np.arange(num_seqs * num_table).reshape(num_seqs, num_table)
        arrays = ChunkArrays(np.cumsum(lengths) - lengths, lengths, starts, tables, block_size, 10**6, 2)
        plan = build_default_plan(arrays, torch.device("cpu"), scratch,
                                  MIN_IN_PLACE_TOKENS if in_place else NEVER_IN_PLACE)
        read = (num_seqs - 1) * context + (context - 1)
        assert plan.stats["in_place"] + plan.stats["gathered"] == read
        if in_place:
            assert plan.stats["gathered"] == 0 and not plan.decode_rounds
            assert all(not work.past_rounds for work in plan.prefills)
            # evenly spaced runs of one length: one call for every decode
            assert len(plan.in_place) == (num_seqs > 1) and plan.in_place[0].units == num_seqs - 1 if num_seqs > 1 else True
            continue
        chunk_counts = [work.seqs.shape[0] for work in plan.decode_rounds]
        assert max(chunk_counts, default=0) * plan.key_chunk <= scratch
        assert sum(work.seqs.numel() for work in plan.decode_rounds) == (num_seqs - 1) * -(-context // DECODE_KEY_CHUNK)
        for work in plan.prefills:
            assert max(rows.shape[0] for rows in work.past_rounds) <= 2 * scratch
            assert sum(rows.shape[0] for rows in work.past_rounds) == 2 * (context - 1)


def test_decodes_sharing_prefix_blocks_read_them_once_and_attend_correctly():
    """Three decodes over one cached 256-position prefix (the same blocks in their tables) and
    tails of their own: the shared run is read in place once, for all three."""
    block_size, prefix = 16, 256
    pool = KVPool(GEOMETRY, num_blocks=64, block_size=block_size, dtype=torch.float32, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(11)
    kp, vp = torch.randn(2, prefix, 8, generator=generator), torch.randn(2, prefix, 8, generator=generator)
    shared_blocks = list(range(prefix // block_size))
    next_block, specs = len(shared_blocks), []
    for context in (300, 290, 257):
        own = -(-(context - prefix) // block_size)
        table = shared_blocks + list(range(next_block, next_block + own))
        next_block += own
        k = torch.cat([kp, torch.randn(2, context - prefix, 8, generator=generator)], dim=1)
        v = torch.cat([vp, torch.randn(2, context - prefix, 8, generator=generator)], dim=1)
        for pos in range(context):
            pool.data[0, 0, :, table[pos // block_size], pos % block_size] = k[:, pos]
            pool.data[0, 1, :, table[pos // block_size], pos % block_size] = v[:, pos]
        specs.append((context, table, torch.randn(4, 1, 8, generator=generator), k, v))
    chunks = [SeqChunk([5], context - 1, table, True) for context, table, *_ in specs]
    step = build_step(chunks, pool, deterministic=False, pad_token_id=0, num_heads=4)
    shared = [call for call in step.plan.in_place if call.sharers == 3]
    assert [(call.units, call.length, call.start) for call in shared] == [(1, prefix, 0)]
    query = torch.cat([q for *_, q, _, _ in specs], dim=1)[None]
    key = torch.stack([k[:, -1] for *_, k, _ in specs], dim=1)[None]
    value = torch.stack([v[:, -1] for *_, v in specs], dim=1)[None]
    out, _ = paged_attention(Layer(), query, key, value, None, scaling=0.3, kvroute_step=step)
    expected = torch.cat([naive(q, k, v, 0.3) for _, _, q, k, v in specs])
    torch.testing.assert_close(out[0], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tile_rows", [(4, 128), (16, 16)])
def test_tiled_kernel_in_scratch_bounded_rounds_gives_the_same_bits(tile_rows):
    """Deterministic mode's kernel under a scratch budget of one pair per round: not a bit
    changes (a row still gets one add per key block, in block order)."""
    specs, num_blocks = _tables(EDGES, 16)
    whole, expected = run(specs, True, tile_rows=tile_rows, block_size=16, num_blocks=num_blocks)
    for scratch in (1, 64, 200):
        rounds, _ = run(specs, True, tile_rows=tile_rows, block_size=16, num_blocks=num_blocks, scratch_tokens=scratch)
        assert torch.equal(rounds, whole), scratch
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-5)


def test_tiled_kernel_sharing_a_cached_prefix_gives_the_same_bits():
    """Decodes over one cached prefix (the same blocks), stacked into one product per shared
    key block: every query gets the bits it gets alone, unshared, in any round size."""
    assert choose_share_rows(4, 8, torch.float32, torch.device("cpu")) == 128
    shared = list(range(8))  # positions 0..127: two key blocks of 64
    specs = [(140, 1, shared + [8 + i], 100 + i) for i in range(40)]  # 40 sharers: units of at most 32
    specs += [(0, 9, [60]), (37, 1, [61, 62, 63])]  # a prefill and a decode of their own
    plans = []
    mixed, expected = run(specs, True, tile_rows=(4, 128), block_size=16, share_rows=128, plans=plans)
    torch.testing.assert_close(mixed, expected, rtol=1e-4, atol=1e-5)
    decode_rounds = plans[0].groups[0].rounds
    assert decode_rounds[0].shared is not None and {p.sharers for p in decode_rounds[0].shared} >= {32, 8}
    unshared, _ = run(specs, True, tile_rows=(4, 128), block_size=16, share_rows=0)
    assert torch.equal(mixed, unshared)
    for scratch in (64, 300):
        rounds, _ = run(specs, True, tile_rows=(4, 128), block_size=16, share_rows=128, scratch_tokens=scratch)
        assert torch.equal(rounds, mixed), scratch
    for index in (0, 17, 39):
        alone, _ = run([specs[index]], True, tile_rows=(4, 128), block_size=16, share_rows=128)
        assert torch.equal(alone, mixed[index : index + 1]), index


def _scattered(specs, block_size, num_blocks, seed):
    """(start, n, table) specs with every table drawn at random from one pool of ``num_blocks``."""
    import random

    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    out = []
    for start, length in specs:
        need = -(-(start + length) // block_size)
        out.append((start, length, ids[:need]))
        ids = ids[need:]
    return out


@pytest.mark.parametrize("layout", ["consecutive", "fragmented", "mixed", "shared", "evenly_spaced"])
@pytest.mark.parametrize("scratch_tokens", [128, 32768])
def test_in_place_runs_match_the_gather_path(layout, scratch_tokens, monkeypatch):
    """The in-place plan (runs of consecutive blocks read from the pool, shared runs once, evenly
    spaced runs in one call) against the gather-only plan and dense attention, within float32
    rounding: consecutive, fragmented and mixed tables, decodes sharing a prefix, prefills."""
    from worker.default_plan import NEVER_IN_PLACE

    block_size = 16
    if layout == "consecutive":
        specs, num_blocks = _tables(EDGES, block_size)
        specs = [(s, n, sorted(t)) for s, n, t in specs]
    elif layout == "fragmented":
        num_blocks = _tables(EDGES, block_size)[1] + 20
        specs = _scattered(EDGES, block_size, num_blocks, seed=3)
    elif layout == "mixed":  # runs of 3 consecutive blocks, then a jump
        specs, next_block = [], 0
        for start, length in EDGES:
            need = -(-(start + length) // block_size)
            table = [next_block + i + 5 * (i // 3) for i in range(need)]
            next_block = table[-1] + 7
            specs.append((start, length, table))
        num_blocks = next_block
    elif layout == "evenly_spaced":  # equal contexts, one after another: a batched strided call
        specs = [(99, 1, list(range(i * 8, i * 8 + 7))) for i in range(6)] + [(40, 20, list(range(60, 64)))]
        specs = [spec + (200 + i,) for i, spec in enumerate(specs)]
        num_blocks = 64
    else:  # decodes over one cached prefix (the same blocks; equal contexts: equal keys), own tails
        prefix = list(range(10))
        specs = [(170, 1, prefix + [20 + 2 * i, 21 + 2 * i], 100 + i) for i in range(6)]
        specs += [(0, 9, [60]), (37, 1, [61, 62, 63])]
        num_blocks = 64
    plans = []
    with monkeypatch.context() as patch:
        patch.setattr("worker.default_plan.MIN_IN_PLACE_TOKENS", NEVER_IN_PLACE)
        gathered, expected = run(specs, False, block_size=block_size, scratch_tokens=scratch_tokens,
                                 num_blocks=num_blocks, plans=plans)
    assert plans[0].stats["in_place"] == 0 and not plans[0].in_place
    plans = []
    in_place, _ = run(specs, False, block_size=block_size, scratch_tokens=scratch_tokens, num_blocks=num_blocks,
                      plans=plans)
    torch.testing.assert_close(in_place, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-6)
    plan = plans[0]
    if layout in ("consecutive", "shared", "evenly_spaced"):
        assert plan.stats["in_place"] > plan.stats["gathered"]
    if layout == "evenly_spaced":
        assert any(call.units == 6 and call.step == 8 * block_size for call in plan.in_place)
    if layout == "shared":
        assert any(call.sharers == 6 and call.length == 160 for call in plan.in_place)
        assert plan.stats["gathered"] <= 6 * 11 + 10  # only the own tails (and the small sequences)



# Prefill chunks of many blocks, with and without a cached prefix, beside decodes.
LONG_PREFILLS = [(0, 64), (0, 65), (17, 130), (100, 200), (0, 257), (40, 1), (300, 1)]


@pytest.mark.parametrize("scratch_tokens", [64, 32768])
def test_long_prefill_chunks_match_dense_attention(scratch_tokens):
    specs, num_blocks = _tables(LONG_PREFILLS, 16)
    out, expected = run(specs, False, block_size=16, scratch_tokens=scratch_tokens, num_blocks=num_blocks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
