"""A Worker's native memory stays bounded under varying step sizes (issue 12's
soak: Workers grew ~400 MiB in 5 minutes with their Python heap flat).

The cause, found with ``python -m harness.soak --probe`` (tracemalloc flat at
~1 MiB, malloc's in-use bytes +337 MiB, its free bytes +73 MiB): oneDNN keeps
one primitive per distinct row count a pre-packed linear has seen (ideep's
LRU and oneDNN's primitive cache, 1,024 entries each, ~0.1-0.6 MiB apiece),
and a serving engine's steps have any number of rows from 1 to
``max_batch_tokens``. :class:`worker.linear.PackedLinear` now pads rows to a
multiple of ``ROW_BUCKET``, so a layer sees at most max_batch_tokens / 16 shapes.
"""

from __future__ import annotations

import torch
import pytest

from harness.memprobe import malloc_in_use_mib
from worker.linear import ROW_BUCKET, PackedLinear, packed_is_available

pytestmark = pytest.mark.skipif(not packed_is_available(torch.float32, torch.device("cpu")),
                                reason="no oneDNN packed linear here")


def test_packed_linear_native_memory_is_bounded_by_row_buckets_not_row_counts():
    # dims no other test uses, so its oneDNN primitives are new in this process
    layer = PackedLinear(torch.randn(328, 200) * 0.05, torch.randn(328))
    layer(torch.randn(3, 200))
    before = malloc_in_use_mib()
    for num_rows in range(1, 321):  # every step size up to 320 rows
        out = layer(torch.randn(num_rows, 200))
        assert out.shape == (num_rows, 328)
    grown = malloc_in_use_mib() - before
    # measured: 320 row counts (before the fix) 180 MiB; 20 buckets of 16 rows 10.7 MiB
    assert grown < 2.0 * 320 / ROW_BUCKET, f"{grown:.1f} MiB of native memory for one layer"


def test_padding_rows_keeps_each_rows_result():
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    layer = PackedLinear(weight, bias)
    x = torch.randn(2, 5, 64)  # 10 rows: padded to 16 inside
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    out = layer(x)
    assert out.shape == (2, 5, 96)
    assert (out.double() - expected).abs().max() < 1e-4
