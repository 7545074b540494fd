"""worker/linear.py: the packed GEMM against F.linear, its bit-stability for deterministic
mode's tiles, and fused projections against the unfused model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.linear import PackedLinear, choose_gemm, fuse_projections, gemm_rows, pack_linears, packed_is_available
from worker.model import TinyLlamaSpec, build_tiny_llama
from worker.numerics import rows_are_invariant

CPU = torch.device("cpu")
needs_packed = pytest.mark.skipif(not packed_is_available(torch.float32, CPU), reason="no oneDNN packed linear here")


@needs_packed
@pytest.mark.parametrize("shape", [(1, 64, 96), (17, 128, 384), (512, 768, 1280), (32, 2048, 768)])
def test_packed_linear_is_within_float32_rounding_of_f_linear(shape):
    rows, in_features, out_features = shape
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    bias = torch.randn(out_features, generator=generator)
    packed = PackedLinear(weight, bias)
    expected = F.linear(x.double(), weight.double(), bias.double())
    # float32 GEMM error grows ~ sqrt(in) ulps: both kernels sit within the same bound of float64.
    tolerance = 4 * in_features**0.5 * torch.finfo(torch.float32).eps * expected.abs().max().item()
    assert (packed(x).double() - expected).abs().max() <= tolerance
    assert (F.linear(x, weight, bias).double() - expected).abs().max() <= tolerance
    assert packed(x[None]).shape == (1, rows, out_features)  # leading dims pass through


@needs_packed
def test_packed_gemm_is_chosen_here_and_its_rows_are_bit_stable_in_sixteen_row_tiles():
    assert choose_gemm(torch.float32, "cpu") == "packed"
    assert choose_gemm(torch.bfloat16, "cpu") == "plain"
    for in_features, out_features in ((128, 256), (768, 1280), (768, 4096), (2048, 768), (768, 32000)):
        assert rows_are_invariant(in_features, out_features, 512, torch.float32, CPU, gemm="packed")
    layer = PackedLinear(torch.randn(384, 128), None)
    x = torch.randn(96, 128)
    full = gemm_rows(x, layer)
    assert all(torch.equal(gemm_rows(x[:n], layer), full[:n]) for n in (16, 32, 48, 96))
    assert torch.equal(gemm_rows(x, layer), full)  # the same call twice: the same bits


def test_fused_projections_compute_the_same_model():
    spec = TinyLlamaSpec()
    plain, fused = build_tiny_llama(spec, 259).eval(), build_tiny_llama(spec, 259).eval()
    counts = fuse_projections(fused)
    assert counts == {"qkv": spec.num_layers, "gate_up": spec.num_layers}
    attention = fused.model.layers[0].self_attn
    assert not hasattr(attention, "q_proj") and attention.qkv_proj.out_features == 128 + 2 * 64
    ids = torch.randint(3, 259, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected, got = plain(ids).logits, fused(ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        if packed_is_available(torch.float32, CPU):
            assert pack_linears(fused) == spec.num_layers * 4 + 1
            assert not any(type(m) is nn.Linear for m in fused.modules())
            torch.testing.assert_close(fused(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_rotary_in_one_pass_gives_hf_rotary_bits_for_q_and_k():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from worker.linear import rotary_matches, rotate_heads

    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 12, 7, 64, generator=generator), torch.randn(1, 4, 7, 64, generator=generator)
    angles = torch.randn(1, 7, 32, generator=generator).repeat(1, 1, 2) * 50
    cos, sin = angles.cos(), angles.sin()
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    both = rotate_heads(torch.cat((q, k), dim=1).transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.equal(both[:, :12], q_ref) and torch.equal(both[:, 12:], k_ref)
    assert rotary_matches(apply_rotary_pos_emb)
    assert not rotary_matches(lambda q, k, cos, sin: (q * cos, k * cos))  # another maths: the model's own is kept
    fused = build_tiny_llama(TinyLlamaSpec(), 259).eval()
    fuse_projections(fused)
    assert all(layer.self_attn.rotate_in_one_pass for layer in fused.model.layers)


@needs_packed
@pytest.mark.parametrize("num_rows", [1, 16, 37])
@pytest.mark.parametrize("has_bias", [False, True])
def test_gemm_with_the_residual_add_fused_gives_the_separate_add_bits(num_rows, has_bias):
    from worker.linear import fused_add_is_exact, linear_add

    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 64, generator=generator) * 0.1
    bias = torch.randn(96, generator=generator) if has_bias else None
    layer = PackedLinear(weight, bias)
    x, residual = torch.randn(1, num_rows, 64, generator=generator), torch.randn(1, num_rows, 96, generator=generator)
    assert fused_add_is_exact()
    fused = layer.forward_add(x, residual)
    assert fused.shape == residual.shape and torch.equal(fused, residual + layer(x))
    assert torch.equal(linear_add(layer, x, residual), residual + layer(x))
    plain = nn.Linear(64, 96, bias=has_bias)
    assert torch.equal(linear_add(plain, x, residual), residual + plain(x))  # not packed: the two ops
