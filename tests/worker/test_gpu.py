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
