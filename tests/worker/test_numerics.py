import torch
from torch import nn

from worker.model import TinyLlamaSpec, build_tiny_llama
from worker.numerics import (
    PerTile,
    RopeTable,
    TiledLinear,
    install_rope_table,
    make_batch_invariant,
    module_rows_are_invariant,
    pad_rows,
    rows_are_invariant,
)


def test_pad_rows_rounds_up_to_whole_tiles():
    assert [pad_rows(n) for n in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 48]


def test_tiled_linear_matches_linear_and_gives_rows_the_same_bits_in_any_batch():
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    x = torch.randn(100, 48)
    for per_tile_bmm in (False, True):
        tiled = TiledLinear(linear, per_tile_bmm=per_tile_bmm)
        full = tiled(x)
        assert full.shape == (100, 40)
        torch.testing.assert_close(full, linear(x), rtol=1e-5, atol=1e-5)
        for count in (1, 2, 3, 5, 17, 64, 99):
            assert torch.equal(tiled(x[:count]), full[:count])
        assert torch.equal(tiled(x[None, 7:9])[0], full[7:9])  # leading dims kept, rows unchanged


def test_per_tile_calls_the_module_per_sixteen_rows():
    calls = []

    class Spy(nn.Module):
        def forward(self, x):
            calls.append(tuple(x.shape))
            return x * 2

    out = PerTile(Spy())(torch.ones(1, 20, 5))
    assert out.shape == (1, 20, 5) and torch.equal(out, torch.full((1, 20, 5), 2.0))
    assert calls == [(16, 5), (16, 5)]


def test_rope_table_equals_the_module_it_replaces():
    model = build_tiny_llama(TinyLlamaSpec(), vocab_size=259)
    rotary = model.model.rotary_emb
    positions = torch.tensor([[0, 5, 77, 1023]])
    x = torch.zeros(1)
    expected = rotary(x, positions)
    assert install_rope_table(model, 1024) == 1
    assert isinstance(model.model.rotary_emb, RopeTable)
    got = model.model.rotary_emb(x, positions)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_invariance_probes_pass_on_this_machine_for_the_tiny_model_shapes():
    # If a BLAS ever fails these, the engine falls back to per-tile bmm / per-tile calls.
    assert rows_are_invariant(128, 256, 512, torch.float32, torch.device("cpu"))
    norm = build_tiny_llama(TinyLlamaSpec(), 259).model.norm
    assert module_rows_are_invariant(norm, 128, 256, torch.float32, torch.device("cpu"))


def test_make_batch_invariant_swaps_every_linear_and_activation():
    model = build_tiny_llama(TinyLlamaSpec(), vocab_size=259)
    counts = make_batch_invariant(model, 256)
    assert counts["linear"] == 2 * 7 + 1 and counts["activation"] == 2 and counts["norm"] == 2 * 2 + 1
    untiled = [c for p in model.modules() if not isinstance(p, TiledLinear) for c in p.children() if type(c) is nn.Linear]
    assert untiled == []
    assert all(isinstance(layer.mlp.act_fn, PerTile) for layer in model.model.layers)


def test_make_batch_invariant_on_packed_weights_keeps_rows_bit_stable():
    """Each tiled linear on the packed GEMM gives a row the same bits in a 16-row
    step as in a 256-row one, and stays within float32 rounding of the plain layer."""
    model = build_tiny_llama(TinyLlamaSpec(), vocab_size=259)
    plain = {name: (m.weight.clone(), m.bias) for name, m in model.named_modules() if type(m) is nn.Linear}
    counts = make_batch_invariant(model, 256, gemm="packed")
    assert counts["packed"] == counts["linear"] == 2 * 7 + 1  # the probe passes on this CPU
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(3))
    layer = model.model.layers[0].self_attn.q_proj
    full = layer(x)
    for count in (1, 5, 16, 17, 100):
        assert torch.equal(layer(x[:count]), full[:count])
    weight, _ = plain["model.layers.0.self_attn.q_proj"]
    torch.testing.assert_close(full, x @ weight.t(), rtol=1e-5, atol=1e-5)
