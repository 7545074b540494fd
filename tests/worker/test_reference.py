"""The plain reference server computes what transformers' own forward computes."""

import pytest
import torch

from worker import reference
from worker.model import build_tiny_llama


@pytest.mark.parametrize("deterministic", [False, True])
def test_reference_tokens_and_logprobs_follow_the_plain_transformers_model(make_engine, tokens, deterministic):
    engine = make_engine(deterministic=deterministic)
    plain = build_tiny_llama(engine.config.tiny_llama, vocab_size=259).eval()
    prompt = tokens(40)
    out, logprobs = reference.generate(engine, prompt, 12, logprobs=True)
    assert len(out) == len(logprobs) and 1 <= len(out) <= 12
    with torch.no_grad():
        logits = plain(torch.tensor([prompt + out])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(out)], dim=-1)
    for step, (token, logprob) in enumerate(zip(out, logprobs)):
        assert abs(expected[step, token].item() - logprob) < 1e-4
        top2 = torch.topk(expected[step], 2).values
        assert expected[step, token] >= top2[0] - 1e-4  # greedy, up to float noise on near ties
    if out[-1] not in engine.eos_token_ids:
        assert len(out) == 12


def test_reference_validates_like_the_engine(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError):
        reference.generate(engine, [], 3)
    with pytest.raises(ValueError):
        reference.generate(engine, [5] * 1020, 10)
