"""A decision's per-replica memo (``router.decision_memo``) and RouterShare's
answer kept for one moment: asked again, the same value, computed once."""

import pytest

from router.decision_memo import PerReplica
from router.router_share import RouterShare


def test_a_replica_figure_is_computed_once_per_memo():
    calls = []

    def compute(replica_id):
        calls.append(replica_id)
        return len(calls) * 10.0

    figure = PerReplica(compute).__getitem__
    assert [figure("a"), figure("b"), figure("a"), figure("b")] == [10.0, 20.0, 10.0, 20.0]
    assert calls == ["a", "b"]
    assert PerReplica(compute).__getitem__("a") == 30.0  # a new decision, a new memo


def test_the_router_count_is_kept_until_a_counter_moves():
    share = RouterShare(window_s=10.0, min_completions=2.0)
    share.on_report("r", "e", 0, 0.0)
    for _ in range(4):
        share.on_completed(1.0)
    share.on_report("r", "e", 1_200, 1.0)  # 1,200 output tokens over 4 completions of 100: 3 routers
    assert share.routers(1.0, 100.0) == 3.0
    assert share.routers(1.0, 100.0) == 3.0  # kept
    assert share.routers(1.0, 50.0) == 6.0  # another mean: asked afresh
    share.on_completed(1.0)  # a counter moved: 1,200 / (5 x 100)
    assert share.routers(1.0, 100.0) == 1200 / 500
    share.on_report("r", "e", 1_700, 1.0)
    assert share.routers(1.0, 100.0) == 1700 / 500
    assert share.routers(2.0, 100.0) == pytest.approx(1700 / 500)  # both counters decay alike: the same ratio later
