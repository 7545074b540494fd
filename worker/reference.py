"""The plain server: what the engine's outputs must equal.

Same weights and numerics as the engine (it borrows the engine's model
runner), none of its machinery: one prefill of the whole prompt into a
private pool, no cache reuse, no batching, no chunking, one decode step per
token, greedy, stopping early only at EOS.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.sampling import SamplingParams, sample
from worker.step import SeqChunk


def generate(engine, prompt: Sequence[int], max_new_tokens: int, logprobs: bool = False):
    """Like ``Engine.generate``: token ids, or ``(token_ids, logprobs)``."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engine.validate(prompt, params)
    runner = engine.runner
    block_size = engine.config.block_size
    num_blocks = -(-(len(prompt) + max_new_tokens) // block_size)
    pool = runner.new_pool(num_blocks, block_size)
    table = list(range(num_blocks))
    logits = runner.forward([SeqChunk(list(prompt), 0, table, True)], pool)
    tokens: list[int] = []
    chosen_logprobs: list[float] = []
    while True:
        (token,), (logprob,) = sample(logits, [params], [None])
        tokens.append(token)
        chosen_logprobs.append(logprob)
        if token in engine.eos_token_ids or len(tokens) == max_new_tokens:
            break
        position = len(prompt) + len(tokens) - 1
        logits = runner.forward([SeqChunk([token], position, table, True)], pool)
    return (tokens, chosen_logprobs) if logprobs else tokens
