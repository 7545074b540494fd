import math

import pytest
import torch

from worker.sampling import SamplingParams, make_generator, sample


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"max_new_tokens": -3},
        {"max_new_tokens": 2.5},
        {"temperature": -0.1},
        {"temperature": "hot"},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"seed": -1},
        {"seed": 1.0},
        {"stop_token_ids": [1, 2]},
        {"stop_token_ids": (1, -2)},
        {"logprobs": 1},
    ],
)
def test_invalid_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_greedy_takes_the_argmax_and_reports_its_float32_logprob():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 3.5]])
    tokens, logprobs = sample(logits, [SamplingParams(), SamplingParams()], [None, None])
    assert tokens == [1, 2]
    expected = torch.log_softmax(logits, dim=-1)
    assert logprobs == [expected[0, 1].item(), expected[1, 2].item()]


def test_rows_do_not_depend_on_their_batch():
    logits = torch.randn(9, 259, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample(logits, [SamplingParams()] * 9, [None] * 9)
    for row in range(9):
        one_token, one_logprob = sample(logits[row : row + 1], [SamplingParams()], [None])
        assert one_token == [tokens[row]] and one_logprob == [logprobs[row]]


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.zeros(1, 200)
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(seed):
        generator = make_generator(seed)
        return [sample(logits, [params], [generator])[0][0] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    greedy, _ = sample(logits, [SamplingParams()] * 4, [None] * 4)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        generators = [make_generator(i) for i in range(4)]
        assert sample(logits, [params] * 4, generators)[0] == greedy


def test_top_k_restricts_the_support():
    logits = torch.arange(10, dtype=torch.float32)[None]
    params = SamplingParams(temperature=5.0, top_k=3)
    generator = make_generator(3)
    seen = {sample(logits, [params], [generator])[0][0] for _ in range(200)}
    assert seen == {7, 8, 9}


def test_logprob_of_a_sampled_token_is_from_the_raw_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    params = SamplingParams(temperature=0.5, seed=0)
    token, logprob = sample(logits, [params], [make_generator(0)])
    assert logprob[0] == torch.log_softmax(logits, -1)[0, token[0]].item()


@pytest.mark.parametrize("vocab", [3, 255, 256, 259, 300, 1000, 32000])
def test_greedy_tokens_are_torch_argmax_with_ties_infinities_and_nans(vocab):
    from worker.sampling import greedy_tokens

    generator = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        logits = torch.randn(6, vocab, generator=generator)
        if trial % 3 == 0:
            logits = (logits * 2).round()  # many tied maxima, across and within blocks
        if trial % 5 == 1:
            logits[0] = float("-inf")
        if trial % 7 == 2:
            logits[-1, vocab // 2] = float("nan")
        if trial % 4 == 3:
            logits[:, -1] = logits.max() + 1  # the maximum in the (short) last block
        if trial % 6 == 5:
            logits[1, :] = 4.0  # one value everywhere: the first column
        assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1)), trial
