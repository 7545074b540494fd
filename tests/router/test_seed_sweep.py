"""router.seed_sweep: spreads and paired differences, and that seed s of a
sweep is exactly ``python -m router.simulate --seed s``."""

import json
import math

import pytest

from router import seed_sweep, simulate

SMALL = ["--workload", "shared-prefix", "--replicas", "3", "--budget-tokens", "1500", "--no-progress",
         "--workload-args", '{"num_groups": 4, "prompts_per_group": 8}']


def test_spread_is_mean_standard_error_min_and_max():
    spread = seed_sweep.Spread.of([1.0, 2.0, 3.0, 6.0])
    assert spread.mean == 3.0
    assert spread.se == pytest.approx(math.sqrt((4 + 1 + 0 + 9) / 3 / 4))
    assert (spread.min, spread.max) == (1.0, 6.0)
    assert seed_sweep.Spread.of([0.5]).se == 0.0
    with pytest.raises(ValueError, match="no samples"):
        seed_sweep.Spread.of([])


def test_paired_differences_are_seed_by_seed():
    # the two series differ by a constant: their means' errors are large, the pairs' error is nil
    assert seed_sweep.paired([1.0, 5.0, 9.0], [0.5, 4.5, 8.5]) == {"mean": 0.5, "se": 0.0}
    with pytest.raises(ValueError, match="cannot pair 2 samples with 3"):
        seed_sweep.paired([1.0, 2.0], [1.0, 2.0, 3.0])


def test_each_seed_of_a_sweep_is_that_seeds_replay(tmp_path):
    out = tmp_path / "sweep.json"
    assert seed_sweep.main(SMALL + ["--policies", "ours,round_robin", "--seed", "3", "--workload-seeds", "2",
                                    "--jobs", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["setup"]["workload_seeds"] == [3, 4]
    for index, seed in enumerate((3, 4)):
        single = tmp_path / f"s{seed}.json"
        simulate.main(SMALL + ["--policies", "ours,round_robin", "--seed", str(seed), "--json", str(single)])
        alone = json.loads(single.read_text())
        for name in ("ours", "round_robin"):
            for figure in seed_sweep.FIGURES:
                assert summary["per_seed"][name][figure][index] == alone["policies"][name][figure]
    hits = summary["per_seed"]["round_robin"]["hit_rate"]
    assert summary["policies"]["round_robin"]["hit_rate"]["mean"] == pytest.approx(sum(hits) / 2)
    ours = summary["per_seed"]["ours"]["hit_rate"]
    assert summary["paired_with"] == "ours"
    assert summary["paired"]["round_robin"]["hit_rate"]["mean"] == pytest.approx(
        sum(h - o for h, o in zip(hits, ours)) / 2)
    assert "ours" not in summary["paired"]


def test_against_pairs_two_sweeps_of_the_same_seeds(tmp_path, capsys):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    base = SMALL + ["--policies", "ours", "--workload-seeds", "2"]
    seed_sweep.main(base + ["--json", str(one)])
    seed_sweep.main(base + ["--routers", "2", "--json", str(two), "--against", str(one)])
    first, second = json.loads(one.read_text()), json.loads(two.read_text())
    imbalance = [b - a for a, b in zip(first["per_seed"]["ours"]["load_imbalance"],
                                       second["per_seed"]["ours"]["load_imbalance"])]
    assert second["paired_against"]["ours"]["load_imbalance"]["mean"] == pytest.approx(sum(imbalance) / 2)
    assert "less the earlier sweep" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # other seeds cannot be paired
        seed_sweep.main(SMALL + ["--policies", "ours", "--workload-seeds", "3", "--json", str(two),
                                 "--against", str(one)])
    assert "the two sweeps ran different workload seeds" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--workload-seeds", "0"], "--workload-seeds must be >= 1"),
    (["--workload-seeds", "2", "--jobs", "0"], "--jobs must be >= 1"),
    (["--workload-seeds", "2", "--seeds", "3"], "give --workload-seeds alone"),
])
def test_bad_sweep_arguments_are_refused_by_name(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        seed_sweep.main(SMALL + ["--policies", "ours", "--json", str(tmp_path / "x.json")] + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
