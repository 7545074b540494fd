import torch

from worker.kv import KVPool, bytes_per_token
from worker.model import KVGeometry

GEOMETRY = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, num_heads=4)


def test_bytes_per_token_is_two_times_layers_heads_dim_dtype():
    assert bytes_per_token(GEOMETRY, torch.float32) == 2 * 3 * 2 * 8 * 4
    assert bytes_per_token(GEOMETRY, torch.bfloat16) == 2 * 3 * 2 * 8 * 2


def test_pool_shape_scratch_block_and_views():
    pool = KVPool(GEOMETRY, num_blocks=5, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    assert pool.data.shape == (3, 2, 2, 6, 4, 8)  # [layers, k/v, kv_heads, blocks + scratch, block_size, D]
    assert pool.scratch_block_id == 5 and pool.num_tokens == 20
    assert pool.num_bytes == 3 * 2 * 6 * 2 * 4 * 8 * 4
    # row ((head * (blocks + 1) + block) * block_size + offset) of rows() is that position of that head
    row = KVPool.row_index(3, 1, 2, 6, 4)
    assert row == (1 * 6 + 3) * 4 + 2
    pool.rows(1, 0)[row] = 7.0
    assert (pool.data[1, 0, 1, 3, 2] == 7.0).all()
    assert pool.data.count_nonzero() == 8
    assert pool.slabs(1, 0, 2).shape == (6 * 2 * 4 // 2, 2, 8)
    assert torch.equal(pool.block_view(1, 0)[3, 1, 2], pool.data[1, 0, 1, 3, 2])


def test_consecutive_blocks_are_one_strided_view_of_every_head():
    """Blocks b .. b + n - 1 of all heads: a slice of positions(), no copy."""
    pool = KVPool(GEOMETRY, num_blocks=5, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    pool.data.normal_()
    view = pool.positions(2, 1)[:, 1 * 4 : 4 * 4]  # blocks 1, 2, 3
    assert view.shape == (2, 12, 8) and view.data_ptr() == pool.data[2, 1, 0, 1].data_ptr()
    for head in range(2):
        for block in (1, 2, 3):
            assert torch.equal(view[head, (block - 1) * 4 : block * 4], pool.data[2, 1, head, block])


def test_copy_blocks_copies_every_layer_and_both_kinds():
    pool = KVPool(GEOMETRY, num_blocks=4, block_size=2, dtype=torch.float32, device=torch.device("cpu"))
    pool.data.normal_()
    before = pool.data.clone()
    pool.copy_blocks([(0, 2), (1, 3)])
    assert torch.equal(pool.data[:, :, :, 2], before[:, :, :, 0])
    assert torch.equal(pool.data[:, :, :, 3], before[:, :, :, 1])
    assert torch.equal(pool.data[:, :, :, :2], before[:, :, :, :2])
    pool.copy_blocks([])
    keys, values = pool.read_block(2, 2)
    assert torch.equal(keys, before[2, 0, :, 0]) and torch.equal(values, before[2, 1, :, 0])
