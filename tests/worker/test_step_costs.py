"""The step-time model a replica fits from its own steps (worker/step_costs.py):
synthetic steps from a known profile, with and without noise."""

from __future__ import annotations

import random

import pytest

from worker.step_costs import StepCosts, StepFit, fit_nonnegative

# a tiny-llama-on-one-CPU-thread-like profile (router/profiles/tiny_llama_cpu.json, rounded)
BASE_S, PREFILL_TOKEN_S, DECODE_SEQ_S = 2e-3, 10e-6, 50e-6
DECODE_COST = (BASE_S + DECODE_SEQ_S) / PREFILL_TOKEN_S  # 205
QUEUE_COST = DECODE_SEQ_S / PREFILL_TOKEN_S  # 5


def step_s(num_prefill: int, num_decode: int, base_s=BASE_S, prefill_token_s=PREFILL_TOKEN_S,
           decode_seq_s=DECODE_SEQ_S) -> float:
    return base_s + prefill_token_s * num_prefill + decode_seq_s * num_decode


def feed(costs: StepCosts, rng: random.Random, num_steps: int, noise: float = 0.0, **profile) -> None:
    """Mixed load: prefill chunks of 16-512 tokens (with 0-8 decodes riding
    along) and decode-only steps of 1-32 sequences, ``noise`` relative jitter."""
    for _ in range(num_steps):
        if rng.random() < 0.5:
            num_prefill, num_decode = rng.randrange(16, 513), rng.randrange(0, 9)
        else:
            num_prefill, num_decode = 0, rng.randrange(1, 33)
        jitter = 1 + rng.uniform(-noise, noise)
        costs.observe(num_prefill, num_decode, step_s(num_prefill, num_decode, **profile) * jitter)


def test_exact_steps_give_the_profile_and_its_prices():
    costs = StepCosts()
    feed(costs, random.Random(0), 400)
    fit = costs.fit()
    assert isinstance(fit, StepFit)
    assert (fit.base_s, fit.prefill_token_s, fit.decode_seq_s) == pytest.approx((BASE_S, PREFILL_TOKEN_S, DECODE_SEQ_S),
                                                                               rel=1e-6)
    assert costs.prices() == pytest.approx((DECODE_COST, QUEUE_COST), rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_noisy_steps_give_the_prices_within_a_few_percent(seed):
    costs = StepCosts()
    feed(costs, random.Random(seed), 400, noise=0.05)
    decode_cost, queue_cost = costs.prices()
    assert decode_cost == pytest.approx(DECODE_COST, rel=0.03)
    assert queue_cost == pytest.approx(QUEUE_COST, rel=0.05)


def test_a_negative_true_coefficient_is_clamped_to_zero():
    """Steps that get *faster* with more decodes (a negative row cost: no engine,
    but what noise or a warming cache can look like) fit a row cost of 0, and
    the other two terms the least squares of what remains."""
    costs = StepCosts()
    feed(costs, random.Random(1), 400, decode_seq_s=-20e-6)
    fit = costs.fit()
    assert fit is not None and fit.decode_seq_s == 0.0 and fit.base_s > 0 and fit.prefill_token_s > 0
    assert costs.prices() == pytest.approx((fit.base_s / fit.prefill_token_s, 0.0))


def test_nnls_agrees_with_plain_least_squares_when_that_is_non_negative():
    steps = [(p, d, step_s(p, d)) for p, d in ((0, 1), (0, 4), (64, 0), (256, 2), (512, 8))]
    assert fit_nonnegative(steps) == pytest.approx((BASE_S, PREFILL_TOKEN_S, DECODE_SEQ_S), rel=1e-9)


def test_nnls_takes_the_best_non_negative_subset():
    """Time falls with P: every subset using P fits a negative slope, so the best
    non-negative fit is a constant: the one of the least squared relative error,
    sum(1/s) / sum(1/s²)."""
    seconds = [1.0 - p / 1000 for p in (100, 200, 300, 400)]
    base_s, prefill_token_s, decode_seq_s = fit_nonnegative([(p, 0, s) for p, s in zip((100, 200, 300, 400), seconds)])
    expected = sum(1 / s for s in seconds) / sum(1 / s**2 for s in seconds)
    assert (base_s, prefill_token_s, decode_seq_s) == pytest.approx((expected, 0.0, 0.0))


def test_collinear_columns_do_not_break_the_fit():
    """Every step with one decoding sequence and no prefill: base and row are one
    column; the fit still returns non-negative coefficients that reproduce the time."""
    base_s, prefill_token_s, decode_seq_s = fit_nonnegative([(0, 1, 3e-3)] * 10)
    assert min(base_s, prefill_token_s, decode_seq_s) >= 0 and base_s + decode_seq_s == pytest.approx(3e-3)


def test_not_measured_with_too_few_steps():
    costs = StepCosts()
    for size in (16, 64, 128, 256, 512, 32, 96):  # 7 prefill steps, 7 decode-only ones
        costs.observe(size, 0, step_s(size, 0))
        costs.observe(0, 4, step_s(0, 4))
    assert costs.fit() is None and costs.prices() == (0.0, 0.0)
    costs.observe(200, 0, step_s(200, 0))
    costs.observe(0, 2, step_s(0, 2))
    assert costs.prices() == pytest.approx((DECODE_COST, QUEUE_COST))


def test_not_measured_with_only_one_kind_of_step():
    prefill_only, decode_only = StepCosts(), StepCosts()
    for size in range(16, 512, 16):
        prefill_only.observe(size, 2, step_s(size, 2))
        decode_only.observe(0, size // 16, step_s(0, size // 16))
    assert prefill_only.prices() == (0.0, 0.0) and decode_only.prices() == (0.0, 0.0)


def test_not_measured_unless_prefill_sizes_span_2x():
    costs = StepCosts()
    for index in range(20):
        size = 300 + 10 * (index % 10)  # 300..390: less than 2x apart
        costs.observe(size, 0, step_s(size, 0))
        costs.observe(0, 1 + index % 8, step_s(0, 1 + index % 8))
    assert costs.prices() == (0.0, 0.0)
    costs.observe(150, 0, step_s(150, 0))
    assert costs.prices() == pytest.approx((DECODE_COST, QUEUE_COST))


def test_steps_of_no_time_or_no_tokens_are_ignored():
    costs = StepCosts()
    costs.observe(0, 0, 1e-3)
    costs.observe(64, 0, 0.0)
    costs.observe(0, 3, -1e-3)
    assert costs.num_samples == (0, 0)


def test_windows_are_bounded_and_a_flood_of_one_kind_keeps_the_other():
    costs = StepCosts()
    feed(costs, random.Random(2), 100)
    prices = costs.prices()
    assert prices == pytest.approx((DECODE_COST, QUEUE_COST))
    for _ in range(10 * StepCosts.WINDOW):  # a long decode tail
        costs.observe(0, 3, step_s(0, 3))
    num_prefill, num_decode = costs.num_samples
    assert num_decode == StepCosts.WINDOW and 8 <= num_prefill <= StepCosts.WINDOW
    assert costs.prices() == pytest.approx(prices)  # the prefill steps still pin the base
    for size in [16, 512] * 5 * StepCosts.WINDOW:  # then a burst of prompts
        costs.observe(size, 0, step_s(size, 0))
    assert costs.num_samples == (StepCosts.WINDOW, StepCosts.WINDOW)
    assert costs.prices() == pytest.approx(prices)
