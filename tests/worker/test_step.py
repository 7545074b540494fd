import pytest
import torch

from worker.attention import DefaultPlan
from worker.kv import KVPool
from worker.model import KVGeometry
from worker.step import SeqChunk, build_step
from worker.tiled_attention import TiledPlan

GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=2, head_dim=4, num_heads=4)


@pytest.fixture
def pool():
    return KVPool(GEOMETRY, num_blocks=10, block_size=4, dtype=torch.float32, device=torch.device("cpu"))


def test_flattened_ids_positions_write_rows_and_logit_rows(pool):
    chunks = [SeqChunk([7, 8, 9], 5, [3, 1], True), SeqChunk([4], 2, [6], False), SeqChunk([5, 6], 0, [2], True)]
    step = build_step(chunks, pool, deterministic=False, pad_token_id=0, num_heads=4)
    assert step.input_ids.tolist() == [7, 8, 9, 4, 5, 6]
    assert step.position_ids.tolist() == [5, 6, 7, 2, 0, 1]
    assert step.logits_rows.tolist() == [2, 5]
    assert step.num_tokens == 6 and isinstance(step.plan, DefaultPlan)

    def row(block, head, offset):  # head-major across the pool's 11 blocks (10 + scratch)
        return (head * 11 + block) * 4 + offset

    expected = [row(1, h, 1) for h in (0,)] + [row(1, 0, 2), row(1, 0, 3), row(6, 0, 2), row(2, 0, 0), row(2, 0, 1)]
    assert step.write_rows.tolist()[:6] == expected
    assert step.write_rows.tolist()[6:] == [row(b, 1, o) for b, o in ((1, 1), (1, 2), (1, 3), (6, 2), (2, 0), (2, 1))]


def test_deterministic_steps_pad_to_whole_tiles_into_the_scratch_block(pool):
    step = build_step([SeqChunk([1, 2, 3], 0, [0], True)], pool, deterministic=True, pad_token_id=9, num_heads=4)
    assert step.input_ids.tolist() == [1, 2, 3] + [9] * 13
    assert step.position_ids.tolist()[3:] == [0] * 13
    scratch_rows = torch.tensor([(head * 11 + pool.scratch_block_id) * 4 for head in (0, 1)])
    assert step.write_rows.view(2, 16)[:, 3:].eq(scratch_rows[:, None]).all()
    assert isinstance(step.plan, TiledPlan) and step.num_tokens == 3


def test_chunk_checks(pool):
    with pytest.raises(ValueError, match="too short"):
        build_step([SeqChunk([1, 2], 3, [0], True)], pool, deterministic=False, pad_token_id=0, num_heads=4)
    with pytest.raises(ValueError, match="at least one"):
        build_step([], pool, deterministic=False, pad_token_id=0, num_heads=4)
