"""The model runner against transformers' own forward, and split-point invariance."""

import random

import pytest
import torch

from worker.model import TinyLlamaSpec, build_tiny_llama
from worker.runner import ModelRunner
from worker.step import SeqChunk

SPEC = TinyLlamaSpec()
PROMPT = [random.Random(7).randrange(3, 259) for _ in range(150)]
TABLE = list(range(10))  # 160 positions at block size 16


@pytest.fixture(scope="module")
def runners():
    return {
        det: ModelRunner("tiny-llama", SPEC, device="cpu", dtype="float32", deterministic=det, max_batch_tokens=256, max_positions=512)
        for det in (False, True)
    }


@pytest.mark.parametrize("deterministic", [False, True])
def test_paged_forward_matches_the_plain_transformers_forward(runners, deterministic):
    runner = runners[deterministic]
    pool = runner.new_pool(16, 16)
    logits = runner.forward([SeqChunk(PROMPT, 0, TABLE, True)], pool)
    plain = build_tiny_llama(SPEC, vocab_size=259).eval()
    with torch.no_grad():
        expected = plain(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)


def test_deterministic_logits_and_kv_are_bit_identical_at_every_split(runners):
    runner = runners[True]
    full_pool = runner.new_pool(16, 16)
    full = runner.forward([SeqChunk(PROMPT, 0, TABLE, True)], full_pool)
    used = full_pool.data[:, :, :, : len(TABLE)]
    for split in list(range(1, 40)) + list(range(40, 150, 9)):
        pool = runner.new_pool(16, 16)
        runner.forward([SeqChunk(PROMPT[:split], 0, TABLE, False)], pool)
        logits = runner.forward([SeqChunk(PROMPT[split:], split, TABLE, True)], pool)
        assert torch.equal(logits, full), split
        kv = pool.data[:, :, :, : len(TABLE)]
        # every position written (0..149) is bit-identical
        for block in range(len(TABLE)):
            upto = min(16, 150 - block * 16)
            assert torch.equal(kv[:, :, :, block, :upto], used[:, :, :, block, :upto]), (split, block)


def test_deterministic_rows_ignore_their_neighbours(runners):
    runner = runners[True]
    other = [random.Random(8).randrange(3, 259) for _ in range(70)]
    alone_pool = runner.new_pool(32, 16)
    runner.forward([SeqChunk(PROMPT[:100], 0, TABLE, False)], alone_pool)
    alone = runner.forward([SeqChunk(PROMPT[100:101], 100, TABLE, True)], alone_pool)
    pool = runner.new_pool(32, 16)
    runner.forward([SeqChunk(other, 0, list(range(10, 15)), False), SeqChunk(PROMPT[:100], 0, TABLE, False)], pool)
    batch = runner.forward(
        [SeqChunk(other[:1], 70, list(range(10, 15)), True), SeqChunk(PROMPT[100:101], 100, TABLE, True)], pool
    )
    assert torch.equal(batch[1], alone[0])


def test_default_mode_is_close_at_every_split(runners):
    runner = runners[False]
    full = runner.forward([SeqChunk(PROMPT, 0, TABLE, True)], runner.new_pool(16, 16))
    for split in (1, 17, 64, 149):
        pool = runner.new_pool(16, 16)
        runner.forward([SeqChunk(PROMPT[:split], 0, TABLE, False)], pool)
        logits = runner.forward([SeqChunk(PROMPT[split:], split, TABLE, True)], pool)
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-5)


def test_steps_that_need_no_logits_return_none(runners):
    runner = runners[True]
    logits = runner.forward([SeqChunk(PROMPT[:10], 0, TABLE, False)], runner.new_pool(16, 16))
    assert logits.shape == (0, 259)
