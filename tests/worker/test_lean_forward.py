"""worker/lean_forward.py: the lean layer loop gives transformers' forward's logits and K/V
bit for bit (default and deterministic mode), and the runner keeps transformers' forward
wherever its load-time probe finds otherwise."""

import random

import pytest
import torch
from torch import nn

from worker.lean_forward import LeanForward, lean_forward_for
from worker.model import TinyLlamaSpec
from worker.runner import ModelRunner
from worker.step import SeqChunk

SPEC = TinyLlamaSpec()


@pytest.fixture(scope="module")
def runners():
    return {
        det: ModelRunner("tiny-llama", SPEC, device="cpu", dtype="float32", deterministic=det,
                         max_batch_tokens=256, max_positions=512)
        for det in (False, True)
    }


def run_both(runner, steps):
    """Each step's logits through the lean path and through transformers', each on a pool of its own."""
    pools = {"lean": runner.new_pool(16, 16), "transformers": runner.new_pool(16, 16)}
    out = {"lean": [], "transformers": []}
    lean = runner.lean
    try:
        for path in ("lean", "transformers"):
            runner.lean = lean if path == "lean" else None
            for chunks in steps:
                out[path].append(runner.forward(chunks, pools[path]))
    finally:
        runner.lean = lean
    return out, pools


@pytest.mark.parametrize("deterministic", [False, True])
def test_lean_forward_is_chosen_and_equals_transformers_bit_for_bit(runners, deterministic):
    runner = runners[deterministic]
    assert runner.forward_path == "lean"
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (37, 80, 21)]
    tables = [list(range(0, 4)), list(range(4, 10)), list(range(10, 13))]
    steps = [
        [SeqChunk(prompts[0], 0, tables[0], True), SeqChunk(prompts[1][:50], 0, tables[1], False)],
        [SeqChunk([5], 37, tables[0], True), SeqChunk(prompts[1][50:], 50, tables[1], True),
         SeqChunk(prompts[2], 0, tables[2], True)],  # a decode, a prefill's second chunk, a new prefill
        [SeqChunk([6], 38, tables[0], True), SeqChunk([7], 80, tables[1], True), SeqChunk([8], 21, tables[2], True)],
    ]
    out, pools = run_both(runner, steps)
    for lean, plain in zip(out["lean"], out["transformers"], strict=True):
        assert lean.dtype == torch.float32 and torch.equal(lean, plain)
    assert torch.equal(pools["lean"].data, pools["transformers"].data)


def test_runner_keeps_transformers_forward_where_the_probe_disagrees(runners):
    runner = runners[False]
    layer = runner.loaded.model.model.layers[0]
    original = layer.forward
    # A model whose decoder layer does more than the standard loop: transformers' forward calls it, the loop does not.
    layer.forward = lambda *args, **kwargs: original(*args, **kwargs) * 2
    try:
        assert not runner._probe_agrees(LeanForward(runner.loaded.model))
    finally:
        del layer.forward
    assert runner._probe_agrees(LeanForward(runner.loaded.model))


def test_lean_can_be_switched_off_and_needs_the_llama_layout():
    runner = ModelRunner("tiny-llama", SPEC, device="cpu", dtype="float32", deterministic=False,
                         max_batch_tokens=64, max_positions=128, lean=False)
    assert runner.forward_path == "transformers" and runner.lean is None
    assert lean_forward_for(nn.Linear(4, 4)) is None
    assert isinstance(lean_forward_for(runner.loaded.model), LeanForward)
