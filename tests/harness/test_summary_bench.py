"""harness/summary_bench.py end to end on a tiny fleet: a live Serve app whose
replicas stream synthetic cache summaries to a router in this process."""

import json

import pytest

pytest.importorskip("ray")

from harness.summary_bench import main  # noqa: E402

pytestmark = pytest.mark.ray


def test_streamed_summaries_cost_fewer_bytes_and_keep_the_router_exact(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--replicas", "2", "--cached-blocks", "4000", "--churn-blocks", "16", "--period-s", "0.5",
                 "--warmup-s", "2", "--seconds", "4", "--json", str(out)]) == 0
    stream, full = json.loads(out.read_text())["results"]
    assert (stream["mode"], full["mode"]) == ("stream", "full")
    assert stream["bytes_per_replica_s"] * 10 < full["bytes_per_replica_s"]
    assert stream["index_holds_current_blocks_min"] == full["index_holds_current_blocks_min"] == 1.0
    assert stream["messages_per_replica_s"] > 0.5
