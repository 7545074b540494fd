"""The native decode kernel (worker/native/) against dense attention, inside the default
plan and on its own, and how the runner chooses it."""

import pytest
import torch

from tests.worker.test_attention import EDGES, _tables, run
from worker import native
from worker.config import EngineConfig
from worker.native_plan import NativePlan
from worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C++ compiler: the torch path is used")


def dense_decode(q, k_pool, v_pool, table, length, block_size, scale):
    """Plain float64 softmax attention of one token's ``q [heads, D]`` over positions ``< length``
    of a paged context (``k_pool``/``v_pool [kv_heads, blocks, block_size, D]``) → ``[heads, D]``."""
    positions = torch.arange(length)
    blocks, offsets = table[positions // block_size], positions % block_size
    group = q.shape[0] // k_pool.shape[0]
    k = k_pool[:, blocks, offsets].double().repeat_interleave(group, 0)  # [heads, n, D]
    v = v_pool[:, blocks, offsets].double().repeat_interleave(group, 0)
    weights = torch.softmax((k @ q.double()[:, :, None])[..., 0] * scale, dim=-1)  # [heads, n]
    return (weights[:, None, :] @ v)[:, 0].float()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_native_plan_attends_every_token_causally(block_size, deterministic):
    """Decodes and prefill chunks at every block/chunk boundary, all through the native kernel;
    deterministic mode pads the step's rows (the padding rows hold no token)."""
    specs, num_blocks = _tables(EDGES, block_size)
    plans = []
    out, expected = run(specs, deterministic, block_size=block_size, num_blocks=num_blocks, native=True, plans=plans)
    assert isinstance(plans[0], NativePlan)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_native_plan_gives_a_token_the_same_bits_in_any_batch_or_chunk():
    """Batch invariance: the last token of a 300-position context, as a decode alone, as a decode
    beside others, and as the last row of prefill chunks of several lengths, has equal bits."""
    block_size = 4
    table = list(range(76))
    outs = []
    for specs, row in (
        ([(299, 1, table)], 0),
        ([(0, 9, [76, 77, 78]), (299, 1, table), (70, 1, list(range(79, 97)))], 9),
        ([(280, 20, table)], 19),
        ([(0, 300, table)], 299),
        ([(5, 3, [97, 98]), (130, 170, table)], 3 + 169),
    ):
        out, _ = run(specs, True, block_size=block_size, num_blocks=128, native=True, keys_of=(0, 300))
        outs.append(out[row])
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_native_and_torch_kernels_agree_on_a_shared_prefix():
    """Decodes sharing a cached prefix's blocks (the same ids in their tables; one (start, n), so
    the helper writes the same keys there for each) with queries and tails of their own."""
    prefix = list(range(8))
    specs = [(40, 1, prefix + [8, 9, 10], 1), (40, 1, prefix + [11, 12, 13], 2), (40, 1, prefix + [14, 15, 16], 3)]
    native_out, expected = run(specs, False, native=True)
    torch_out, _ = run(specs, False)
    torch.testing.assert_close(native_out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(native_out, torch_out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", [(4, 2, 8), (12, 4, 64), (14, 2, 64), (32, 8, 128), (8, 8, 40), (16, 1, 256)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_self_check_passes_for_supported_geometries(heads, block_size):
    """GQA groups 1..16 (blocks of 3 score rows and 4 value rows, with remainders), head dims
    with an odd number of 8-lanes vectors, contexts over several 128-key chunks."""
    num_heads, num_kv_heads, head_dim = heads
    assert native.supports(num_heads, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    assert native.self_check(num_heads, num_kv_heads, head_dim, block_size)


def test_unsupported_geometry_is_refused_not_miscomputed():
    assert not native.supports(12, 4, 60, torch.float32, torch.device("cpu"))  # head_dim not a multiple of 8
    assert not native.supports(34, 2, 64, torch.float32, torch.device("cpu"))  # group of 17
    assert not native.supports(12, 4, 64, torch.bfloat16, torch.device("cpu"))
    q = torch.zeros(1, 34, 64)
    pool = torch.zeros(2, 2, 16, 64)
    with pytest.raises(ValueError, match="does not support"):
        native.paged_decode(q, pool, pool, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
                            16, 0.125)


def test_a_large_context_in_a_long_sequence_of_chunks_stays_accurate():
    """8k positions in one sequence: the online softmax's rescaling over 64 chunks."""
    generator = torch.Generator().manual_seed(3)
    length, block_size = 8192, 16
    pool_k = torch.randn(2, length // block_size + 1, block_size, 64, generator=generator)
    pool_v = torch.randn(2, length // block_size + 1, block_size, 64, generator=generator)
    table = torch.randperm(length // block_size, generator=generator)[None].contiguous()
    q = torch.randn(1, 6, 64, generator=generator) * 3  # peaked scores
    got = native.paged_decode(q, pool_k, pool_v, table, torch.tensor([length]), block_size, 0.125)
    expected = dense_decode(q[0], pool_k, pool_v, table[0], length, block_size, 0.125)
    torch.testing.assert_close(got[0], expected, rtol=1e-4, atol=1e-5)


def test_build_reuses_the_cached_library(tmp_path):
    first = native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_runner_chooses_the_native_kernel_where_it_runs():
    assert ModelRunner.from_config(EngineConfig()).attention_path == "native"
    assert ModelRunner.from_config(EngineConfig(attention_kernel="torch")).attention_path == "torch"
    assert ModelRunner.from_config(EngineConfig(deterministic=True)).attention_path == "native"
    assert ModelRunner.from_config(EngineConfig(attention_kernel="native")).attention_path == "native"
    assert ModelRunner.from_config(EngineConfig(deterministic=True, attention_kernel="torch")).attention_path == "tiled"
    with pytest.raises(ValueError, match="attention_kernel"):
        EngineConfig(attention_kernel="fast")
    with pytest.raises(ValueError, match="native"):
        EngineConfig(attention_kernel="native", dtype="bfloat16")


def test_member_groups_share_the_common_prefix_rounded_down_to_whole_chunks():
    """Decodes 0 and 2 start with block 7 (a cached prefix of 10 blocks = 160 positions), 1 with
    block 30: groups go by first block; a group's shared length is its common leading blocks,
    capped by its shortest member, rounded down to a multiple of the kernel's 128-key chunk."""
    import numpy as np

    prefix = list(range(7, 17))
    tables = np.array([prefix + [20, 21], list(range(30, 42)), prefix + [22, 23]])
    seqs = np.arange(3)
    groups = native.MemberGroups.of(tables, seqs, seqs, np.array([170, 180, 190]), block_size=16, num_kv_heads=2,
                                    max_members=8)
    assert groups.rows.tolist() == [0, 2, 1] and groups.starts.tolist() == [0, 2, 3]
    assert groups.shared_lens.tolist() == [128, 128]  # min(160, 170) and 180, rounded down
    assert groups.items.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    alone = native.MemberGroups.of(tables, seqs, seqs, np.array([170, 180, 100]), 16, 1, max_members=1)
    assert alone.starts.tolist() == [0, 1, 2, 3] and alone.shared_lens.tolist() == [128, 0, 128]
    chunk = native.MemberGroups.of(tables, np.array([0, 0, 0]), np.array([4, 5, 6]), np.array([130, 131, 132]), 16, 1, 8)
    assert chunk.rows.tolist() == [4, 5, 6] and chunk.shared_lens.tolist() == [128]  # a prefill chunk's tokens


@pytest.mark.parametrize("max_members", [1, 2, 64])
def test_grouped_decodes_over_a_shared_prefix_match_dense_attention(max_members):
    import numpy as np

    """Five decodes over one 304-position prefix (shared blocks) with tails of different lengths,
    one of them shorter than the prefix's last block, beside two unrelated decodes."""
    generator = torch.Generator().manual_seed(5)
    block_size, num_kv_heads, num_heads, head_dim = 16, 2, 6, 16
    pool_k = torch.randn(num_kv_heads, 120, block_size, head_dim, generator=generator)
    pool_v = torch.randn(num_kv_heads, 120, block_size, head_dim, generator=generator)
    prefix = list(range(19))  # 304 positions
    tables, lens, next_block = [], [], 19
    for length in (340, 303, 310, 330, 400):
        own = -(-length // block_size) - len(prefix)
        tables.append(prefix + list(range(next_block, next_block + max(own, 0))))
        next_block += max(own, 0)
        lens.append(length)
    for length in (50, 77):
        count = -(-length // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
        lens.append(length)
    width = max(map(len, tables))
    table = torch.tensor([t + [119] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), num_heads, head_dim, generator=generator)
    seqs = np.arange(len(lens))
    groups = native.MemberGroups.of(table.numpy(), seqs, seqs, np.array(lens), block_size, num_kv_heads, max_members)
    got = native.paged_attention(q, pool_k, pool_v, table, groups, block_size, 0.25, torch.empty_like(q))
    for seq, length in enumerate(lens):
        expected = dense_decode(q[seq], pool_k, pool_v, table[seq], length, block_size, 0.25)
        torch.testing.assert_close(got[seq], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", [(4, 2, 8), (12, 4, 64), (14, 2, 64), (32, 8, 128)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_invariance_self_check_passes_for_supported_geometries(heads, block_size):
    assert native.self_check_invariance(*heads, block_size)

