"""Output-length quantiles: what a summary carries of a replica's output tail."""

import pytest

from cache.output_quantiles import NUM_OUTPUT_QUANTILES, check_output_quantiles, output_quantiles
from cache.summary import CacheSummary


def test_quantiles_split_the_lengths_into_equal_shares():
    assert output_quantiles(range(1, 101), 4) == (13, 38, 63, 88)
    assert output_quantiles([5], 3) == (5, 5, 5)
    assert output_quantiles([]) == ()
    points = output_quantiles([1] * 60 + [700] * 4)
    assert len(points) == NUM_OUTPUT_QUANTILES and points[-1] == 700 and points[0] == 1
    assert list(points) == sorted(points)


@pytest.mark.parametrize("bad", [(3, 1), (-1,), (1.5,), [1, 2], (True,), tuple(range(257))])
def test_a_malformed_sketch_is_refused(bad):
    with pytest.raises(ValueError, match="output_quantiles"):
        check_output_quantiles(bad)


def test_the_summary_carries_them_in_both_formats():
    summary = CacheSummary("r", 3, 1.0, 4, frozenset({7}), output_quantiles=(2, 9, 40))
    for compact in (True, False):
        assert CacheSummary.from_dict(summary.to_dict(compact=compact)) == summary
    assert "oq" not in CacheSummary("r", 3, 1.0, 4, frozenset()).to_dict()  # none: left out of the wire
    wire = summary.to_dict()
    for bad in ([9, 2], "2,9", [2, -9]):
        with pytest.raises(ValueError, match="output_quantiles"):
            CacheSummary.from_dict({**wire, "oq": bad})
    with pytest.raises(ValueError, match="output_quantiles"):
        CacheSummary("r", 3, 1.0, 4, frozenset(), output_quantiles=(9, 2))
