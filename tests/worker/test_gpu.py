"""CUDA checks; skipped cleanly where there is no GPU."""

import pytest
import torch

from worker import Engine, EngineConfig, SamplingParams, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_cuda_matches_its_plain_server_in_deterministic_mode(dtype):
    engine = Engine(EngineConfig(device="cuda", dtype=dtype, deterministic=True, cache_budget_tokens=4096,
                                 kv_pool_tokens=16384, max_batch_tokens=128, max_model_len=1024))
    system = list(range(3, 83))
    prompts = [system + [100 + i, 101 + i, 7] for i in range(8)]
    outputs = engine.generate_batch(prompts, 10, logprobs=True)
    for prompt, output in zip(prompts, outputs):
        assert output == reference.generate(engine, prompt, 10, logprobs=True)
    assert engine.stats["hits"] == 7
    engine.check_invariants()


def test_pool_sized_from_free_gpu_memory():
    engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", cache_budget_tokens=4096, max_model_len=1024))
    assert engine.allocator.num_blocks * engine.config.block_size > 4096
    out = engine.generate([5, 6, 7], 4)
    assert len(out) >= 1
    request_id = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.8, seed=3))
    assert len(engine.run([request_id])[request_id].token_ids) >= 1


def _runner(**kwargs):
    from worker.model import TinyLlamaSpec
    from worker.runner import ModelRunner

    return ModelRunner("tiny-llama", TinyLlamaSpec(), device="cuda", dtype="float32", deterministic=False,
                       max_positions=4096, **kwargs)


def _mixed_step(runner, pool, seed):
    """Three cached contexts of mixed lengths, then one step: two decodes and a prefill chunk."""
    from worker.step import SeqChunk

    generator = torch.Generator().manual_seed(seed)
    lengths, tables, next_block = (700, 129, 33), [], 0
    for length in lengths:
        num_blocks = -(-(length + 40) // pool.block_size)
        tables.append(list(range(next_block, next_block + num_blocks))[::-1])
        next_block += num_blocks
        runner.forward([SeqChunk(torch.randint(3, 259, (length,), generator=generator).tolist(), 0, tables[-1], False)], pool)
    chunks = [SeqChunk([7], 700, tables[0], True), SeqChunk([8], 129, tables[1], True),
              SeqChunk(list(range(3, 40)), 33, tables[2], True)]
    return runner.forward(chunks, pool)


def test_flashinfer_kernel_agrees_with_the_torch_kernel():
    from worker.gpu_attention import flashinfer_available

    if not flashinfer_available():
        pytest.skip("flashinfer is not installed")
    fast, plain = _runner(attention_kernel="flashinfer"), _runner(attention_kernel="torch")
    assert fast.flashinfer and not plain.flashinfer
    logits = [_mixed_step(r, r.new_pool(128, 16), seed=5) for r in (fast, plain)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-3, atol=1e-3)


def test_torch_kernel_on_cuda_keeps_its_scratch_flat_in_batch_and_context():
    """Peak memory a decode step allocates beyond the pool: about the same for 8 x 1k
    and 64 x 8k contexts (the old gather-everything kernel grew 64x)."""
    from worker.step import SeqChunk

    runner = _runner(attention_kernel="torch", attention_scratch_tokens=4096)

    def extra_bytes(batch, context):
        blocks = -(-context // 16)
        pool = runner.new_pool(batch * blocks, 16)
        chunks = [SeqChunk([5], context - 1, list(range(i * blocks, (i + 1) * blocks)), True) for i in range(batch)]
        runner.forward(chunks, pool)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        runner.forward(chunks, pool)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, big = extra_bytes(8, 1024), extra_bytes(64, 4096)
    assert big < 1.5 * small + 32 * 2**20, (small, big)
