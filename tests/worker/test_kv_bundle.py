"""Exporting a cached prefix's KV from one engine and importing it into another."""

import dataclasses

import pytest
import torch

from worker import reference
from worker.kv_bundle import BUNDLE_FORMAT, KVBundle


def prefilled(engine, fn):
    before = engine.stats["prefill_tokens"]
    result = fn()
    return result, engine.stats["prefill_tokens"] - before


def snapshot(engine):
    """What must be back to baseline after a refused import."""
    allocator = engine.allocator
    refs = [allocator.ref_count(b) for b in range(allocator.num_blocks)]
    return allocator.num_free_blocks, refs, engine.cache.num_tokens, engine.cache.num_locks


def assert_clean(engine):
    engine.check_invariants()
    assert engine.cache.num_locked_tokens == 0 and engine.cache.num_locks == 0
    allocator = engine.allocator
    for block_id in range(allocator.num_blocks):  # idle: every block free or held only by the tree
        assert allocator.ref_count(block_id) == allocator.retained_count(block_id), block_id


@pytest.fixture
def pair(make_engine):
    return make_engine(seed=7), make_engine(seed=7)


def test_export_of_an_uncached_prefix_is_none(make_engine, tokens):
    engine = make_engine()
    assert engine.export_prefix(tokens(20)) is None
    assert_clean(engine)


def test_export_is_token_exact_with_the_partial_last_block(make_engine, tokens):
    engine = make_engine()
    prompt = tokens(37)  # 2 full blocks of 16 + 5 rows
    engine.generate(prompt, 1)
    before = snapshot(engine)
    bundle = engine.export_prefix(prompt + tokens(5))
    assert bundle.token_ids == tuple(prompt) and bundle.num_tokens == 37
    geometry = engine.runner.geometry
    assert tuple(bundle.rows.shape) == (geometry.num_layers, 2, geometry.num_kv_heads, 37, geometry.head_dim)
    assert bundle.num_bytes == 37 * engine.bytes_per_token
    table = engine.cache.match(prompt, touch=False).block_ids
    keys, values = engine.pool.read_block(1, table[2])
    assert torch.equal(bundle.rows[1, 0, :, 32:37], keys[:, :5])
    assert torch.equal(bundle.rows[1, 1, :, 32:37], values[:, :5])
    assert snapshot(engine) == before  # a pure read
    assert engine.export_prefix(prompt, max_tokens=10).num_tokens == 10
    assert_clean(engine)


@pytest.mark.parametrize("num_prompt", [37, 48])
def test_imported_prefix_is_reused_and_outputs_match_the_reference(pair, tokens, num_prompt):
    a, b = pair
    prompt, suffix = tokens(num_prompt), tokens(9)
    a.generate(prompt, 4)
    bundle = a.export_prefix(prompt)
    assert b.import_prefix(bundle) == num_prompt
    assert b.import_prefix(bundle) == 0  # cached already
    assert_clean(b)
    assert (a.stats["kv_exported_tokens"], b.stats["kv_imported_tokens"]) == (num_prompt, num_prompt)
    out, cost = prefilled(b, lambda: b.generate(prompt + suffix, 6, logprobs=True))
    assert cost == len(suffix)
    assert out == reference.generate(b, prompt + suffix, 6, logprobs=True)
    out, cost = prefilled(b, lambda: b.generate(prompt, 6, logprobs=True))  # the whole prompt: last token recomputed
    assert cost == 1
    assert out == reference.generate(b, prompt, 6, logprobs=True)
    assert_clean(b)


def test_import_over_a_partly_cached_prefix_copies_the_shared_block(pair, tokens):
    a, b = pair
    common = tokens(20)  # ends inside block 1
    b.generate(common, 1)  # b caches 20 positions of its own
    prompt = common + tokens(30)
    a.generate(prompt, 1)
    bundle = a.export_prefix(prompt)
    assert b.import_prefix(bundle) == 30
    assert_clean(b)
    assert b.cache.match(common, touch=False).num_tokens == 20  # b's own entry still there
    out, cost = prefilled(b, lambda: b.generate(prompt + [5, 6, 7], 4, logprobs=True))
    assert cost == 3
    assert out == reference.generate(b, prompt + [5, 6, 7], 4, logprobs=True)


def test_salt_namespace_is_respected(pair, tokens):
    a, b = pair
    prompt = tokens(40)
    a.add_request(prompt, salt="a")
    a.run(["req-0"])
    assert a.export_prefix(prompt) is None and a.export_prefix(prompt, salt="b") is None
    bundle = a.export_prefix(prompt, salt="a")
    assert bundle.salt == "a"
    assert b.import_prefix(bundle) == 40
    assert b.cache.match(prompt, "a", touch=False).num_tokens == 40
    assert b.cache.match(prompt, "b", touch=False).num_tokens == 0
    assert b.cache.match(prompt, None, touch=False).num_tokens == 0
    _, cost = prefilled(b, lambda: b.run([b.add_request(prompt + [9], salt="b")]))
    assert cost == 41
    _, cost = prefilled(b, lambda: b.run([b.add_request(prompt + [9], salt="a")]))
    assert cost == 1
    assert_clean(b)


def tampered(bundle, **changes):
    return dataclasses.replace(bundle, **changes)


def test_bad_bundles_raise_and_change_nothing(pair, tokens):
    a, b = pair
    prompt = tokens(37)
    a.generate(prompt, 1)
    bundle = a.export_prefix(prompt)
    b.generate(tokens(30), 1)
    before = snapshot(b)
    flipped = bundle.rows.clone()
    flipped[0, 1, 0, 3, 0] += 1.0
    bad = {
        "checksum": tampered(bundle, checksum=bundle.checksum ^ 1),
        "rows": tampered(bundle, rows=flipped),
        "tokens": tampered(bundle, token_ids=bundle.token_ids[:-1] + (4,)),
        "salt": tampered(bundle, salt="other"),
        "model": tampered(bundle, model_id="some/other-model"),
        "weights": tampered(bundle, weights_fingerprint=bundle.weights_fingerprint ^ 1),
        "geometry": tampered(bundle, num_kv_heads=bundle.num_kv_heads + 1),
        "shape": tampered(bundle, rows=bundle.rows[:, :, :, :-1].contiguous()),
        "dtype": tampered(bundle, rows=bundle.rows.to(torch.float64), dtype="float64"),
        "vocab": KVBundle.build(
            model_id=bundle.model_id, num_layers=bundle.num_layers, num_kv_heads=bundle.num_kv_heads,
            head_dim=bundle.head_dim, block_size=16, weights_fingerprint=bundle.weights_fingerprint,
            token_ids=(10**6,), salt=None, rows=bundle.rows[:, :, :, :1],
        ),
    }
    for name, candidate in bad.items():
        with pytest.raises(ValueError):
            b.import_prefix(candidate)
        assert snapshot(b) == before, name
    with pytest.raises(ValueError):
        b.import_prefix("not a bundle")
    assert_clean(b)


def test_failure_while_writing_releases_everything(pair, tokens, monkeypatch):
    a, b = pair
    prompt = tokens(40)
    a.generate(prompt, 1)
    bundle = a.export_prefix(prompt)
    before = snapshot(b)

    def boom(*args, **kwargs):
        raise RuntimeError("copy interrupted")

    monkeypatch.setattr("worker.engine.scatter_rows", boom)
    with pytest.raises(RuntimeError):
        b.import_prefix(bundle)
    assert snapshot(b) == before
    assert_clean(b)


def test_import_into_a_nearly_full_pool_evicts_lru_entries(make_engine, tokens):
    config = dict(seed=3, cache_budget_tokens=128, kv_pool_tokens=160, max_model_len=96, max_batch_tokens=64)
    a, b = make_engine(**config), make_engine(**config)
    old = [tokens(30) for _ in range(4)]
    for prompt in old:
        b.generate(prompt, 1)  # 120 positions cached: the tree is nearly at budget
    assert b.cache.num_tokens == 120
    prompt = tokens(60)
    a.generate(prompt, 1)
    assert b.import_prefix(a.export_prefix(prompt)) == 60
    cached = [b.cache.match(p, touch=False).num_tokens for p in old]
    assert cached[:2] == [0, 0] and cached[2:] == [30, 30]  # least recently used went first
    assert_clean(b)
    out, cost = prefilled(b, lambda: b.generate(prompt + [7], 3, logprobs=True))
    assert cost == 1 and out == reference.generate(b, prompt + [7], 3, logprobs=True)


def test_import_refuses_cleanly_when_running_requests_hold_the_pool(make_engine, tokens):
    config = dict(seed=3, cache_budget_tokens=128, kv_pool_tokens=160, max_model_len=160, max_batch_tokens=256)
    a, b = make_engine(**config), make_engine(**config)
    prompt = tokens(60)
    a.generate(prompt, 1)
    bundle = a.export_prefix(prompt)
    request_id = b.add_request(tokens(100))  # 7 of the 10 blocks; 60 positions need 4 + the watermark
    b.step()  # the prompt's blocks are now held by a running request
    before = snapshot(b)
    assert b.import_prefix(bundle) == 0
    assert snapshot(b) == before
    b.check_invariants()
    b.run([request_id])
    assert b.import_prefix(bundle) == 60
    assert_clean(b)


def test_bundle_larger_than_the_budget_is_not_imported(make_engine, tokens):
    a = make_engine(seed=3)
    b = make_engine(seed=3, cache_budget_tokens=32, kv_pool_tokens=1024)
    prompt = tokens(40)
    a.generate(prompt, 1)
    before = snapshot(b)
    assert b.import_prefix(a.export_prefix(prompt)) == 0
    assert snapshot(b) == before
    assert_clean(b)


def test_async_engines_export_and_import_between_steps_and_audit_clean(make_async_engine, tokens):
    import asyncio

    from worker import SamplingParams
    from worker.audit import audit

    async def main():
        a, b = make_async_engine(seed=5), make_async_engine(seed=5)
        prompt = tokens(45)
        params = SamplingParams(max_new_tokens=4, logprobs=True)
        await a.generate(prompt, params, salt="t")
        bundle = a.export_prefix(prompt, "t")
        assert b.import_prefix(bundle) == 45
        assert audit(b).is_clean and audit(a).is_clean
        result = await b.generate(prompt + [11, 12], params, salt="t")
        expected = reference.generate(b.engine, prompt + [11, 12], 4, logprobs=True)
        assert (list(result.token_ids), list(result.logprobs)) == expected
        assert result.cached_tokens == 45
        await b.wait_idle()
        assert audit(b).is_clean
        await a.shutdown()
        await b.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bundle_checksum_covers_every_dtype_and_field(dtype):
    rows = torch.arange(2 * 2 * 1 * 3 * 4, dtype=torch.float32).view(2, 2, 1, 3, 4).to(dtype)
    geometry = dict(num_layers=2, num_kv_heads=1, head_dim=4, weights_fingerprint=99)
    bundle = KVBundle.build(model_id="m", block_size=16, token_ids=[5, 6, 7], salt="s", rows=rows, **geometry)
    bundle.check(model_id="m", dtype=dtype, **geometry)
    assert bundle.dtype == str(dtype).removeprefix("torch.") and bundle.num_bytes == rows.numel() * rows.element_size()
    for changed in (dict(salt=None), dict(token_ids=(5, 6, 8)), dict(model_id="n"), dict(weights_fingerprint=98),
                    dict(format_version=BUNDLE_FORMAT + 1)):
        with pytest.raises(ValueError):
            dataclasses.replace(bundle, **changed).check(model_id=changed.get("model_id", "m"), dtype=dtype, **geometry)


def bits(tensor):
    """``tensor`` as integers of its width: equal iff bitwise equal (NaN payloads included)."""
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


def random_pool(block_size, dtype, seed):
    from worker.kv import KVPool
    from worker.model import KVGeometry

    pool = KVPool(KVGeometry(num_layers=2, num_kv_heads=3, head_dim=5, num_heads=6), num_blocks=24,
                  block_size=block_size, dtype=dtype, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(-2**15, 2**15, pool.data.shape, dtype=torch.int32, generator=generator)
    pool.data.copy_(raw.to(torch.int16).view(dtype) if pool.data.element_size() == 2 else raw.view(dtype))
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 16, 17, 37])
def test_gather_then_scatter_round_trips_bitwise(dtype, block_size, num_tokens):
    """Whole prompts, partial last blocks and one-block prompts, written back
    from every start position (inside a block or on its edge) into another
    pool's scattered blocks: the rows are the pool's, bit for bit, and nothing
    outside ``[start_pos, num_tokens)`` of the table is touched."""
    from worker.kv_bundle import gather_rows, scatter_rows

    source, target = random_pool(block_size, dtype, 1), random_pool(block_size, dtype, 2)
    num_blocks = -(-num_tokens // block_size)
    source_table = [(7 * i + 3) % 24 for i in range(num_blocks)]  # neither ordered nor consecutive
    target_table = [(5 * i + 11) % 24 for i in range(num_blocks)]
    positions = torch.arange(num_tokens)

    def per_position(pool, table):  # [layers, 2, kv_heads, positions, head_dim]
        blocks = torch.tensor(table)[positions // block_size]
        return pool.data[:, :, :, blocks, positions % block_size, :]

    rows = gather_rows(source, source_table, num_tokens)
    assert rows.is_contiguous() and rows.shape == (2, 2, 3, num_tokens, 5)
    assert torch.equal(bits(rows), bits(per_position(source, source_table)))
    for start_pos in sorted({0, 1, block_size - 1, block_size, block_size + 1, num_tokens - 1, num_tokens} & set(
            range(num_tokens + 1))):
        pool = random_pool(block_size, dtype, 2)
        expected = pool.data.clone()
        blocks = torch.tensor(target_table)[positions[start_pos:] // block_size]
        expected[:, :, :, blocks, positions[start_pos:] % block_size, :] = rows[:, :, :, start_pos:]
        scatter_rows(pool, target_table, start_pos, rows[:, :, :, start_pos:])
        assert torch.equal(bits(pool.data), bits(expected)), start_pos
        assert torch.equal(bits(per_position(pool, target_table)[:, :, :, start_pos:]), bits(rows[:, :, :, start_pos:]))
    with pytest.raises(ValueError):
        gather_rows(source, source_table, num_blocks * block_size + 1)
    with pytest.raises(ValueError):
        scatter_rows(target, target_table, num_blocks * block_size - num_tokens + 1, rows)  # one past the table


def test_a_bundle_of_the_old_token_major_format_is_refused(pair, tokens):
    """A format-1 exporter (rows ``[layers, 2, tokens, kv_heads, head_dim]``,
    no ``format_version`` on the wire) is refused by name, even when its
    rows' shape happens to equal this format's (tokens == kv_heads)."""
    import pickle

    from worker.kv_bundle import _bundle_from_wire

    a, b = pair
    num_kv_heads = a.runner.geometry.num_kv_heads
    prompt = tokens(num_kv_heads)
    a.generate(prompt, 1)
    bundle = a.export_prefix(prompt)
    assert bundle.format_version == BUNDLE_FORMAT == 2
    arrived = pickle.loads(pickle.dumps(bundle))
    assert arrived.format_version == BUNDLE_FORMAT and torch.equal(arrived.rows, bundle.rows)
    old_rows = bundle.rows.transpose(2, 3).contiguous()  # what a format-1 exporter sent
    _, (fields, _, dtype, _) = bundle.__reduce__()
    old = _bundle_from_wire(fields[:-1], old_rows.view(-1).view(torch.uint8).numpy(), dtype, tuple(old_rows.shape))
    assert old.format_version == 1 and old.rows.shape == bundle.rows.shape
    before = snapshot(b)
    for candidate in (old, tampered(bundle, format_version=1)):
        with pytest.raises(ValueError, match="format 1"):
            b.import_prefix(candidate)
        assert snapshot(b) == before
    assert_clean(b)


def test_an_imported_prefix_is_protected_only_when_reused_a_second_time(pair, tokens):
    """A copy of KV held elsewhere is the cheapest entry to lose: the request it was imported for does
    not protect it (the simulator's replicas behave the same), a second request reusing it does."""
    a, b = pair
    prompt = tokens(48)
    a.generate(prompt, 2)
    assert b.import_prefix(a.export_prefix(prompt)) == 48
    b.generate(prompt + tokens(8), 2)  # the request the prefix was fetched for
    assert b.stats["cache_protected_tokens"] == 0
    b.generate(prompt + tokens(8), 2)  # reused again here
    assert b.stats["cache_protected_tokens"] == 48
    assert_clean(b)
