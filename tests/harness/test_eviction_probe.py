"""harness.eviction_probe: the pooled-cache eviction rules it compares, and
that none passes the hit ceiling."""

import random

import pytest

from harness.eviction_probe import (BranchAdmission, Lru, S3Fifo, SegmentedLru, main, next_reads, probe, replay,
                                   unit_paths)
from router.floors import hit_ceiling
from router.workload import SimRequest, Workload


def request(arrival_s, tokens):
    return SimRequest(arrival_s, tuple(tokens), 1, len(tokens), 1, (), tuple(tokens))


def random_workload(seed, num_requests=300):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(20, 120))] for _ in range(8)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
               for _ in range(num_requests)]
    return Workload(tuple(request(float(i), prompt) for i, prompt in enumerate(prompts)), 1, 16, "random")


@pytest.mark.parametrize("rule", [Lru, SegmentedLru, S3Fifo])
def test_a_rule_never_holds_more_than_its_room(rule):
    cache = rule(10)
    rng = random.Random(0)
    for _ in range(2000):
        node = rng.randrange(40)
        if node in cache:
            cache.read(node)
        else:
            cache.write(node)
        assert sum(node in cache for node in range(40)) <= 10


@pytest.mark.parametrize("rule", [SegmentedLru, S3Fifo])
def test_a_unit_read_again_outlives_a_scan_of_one_offs_where_lru_drops_it(rule):
    for cache, survives in ((rule(10), True), (Lru(10), False)):
        cache.write(0)
        cache.read(0)
        for node in range(1, 30):  # each written once, never read
            cache.write(node)
        assert (0 in cache) is survives


def test_oracle_admission_caches_only_what_a_later_prompt_reads():
    workload = Workload((request(0.0, [1, 2]), request(1.0, [3, 4]), request(2.0, [1, 5])), 1, 16, "hand")
    paths = unit_paths(workload)
    upcoming = next_reads(paths)
    cache = Lru(100)
    replay(workload, paths, cache, lambda number, node: upcoming[number][node] != float("inf"))
    assert list(cache.kept) == [paths[0][0][0]]  # the unit [1]: the only one read again


def test_branch_admission_stops_caching_one_off_branches_of_a_point_and_keeps_a_chat():
    doc = [1, 2, 3]
    questions = [doc + [10 * q, 10 * q + 1] for q in range(1, 6)]  # one-off questions under one document
    chat = [[7, 8], [7, 8, 9], [7, 8, 9, 4], [7, 8, 9, 4, 5]]  # each turn extends the last
    workload = Workload(tuple(request(float(i), p) for i, p in enumerate(questions + chat)), 1, 16, "hand")
    paths = unit_paths(workload)
    cache = Lru(100)
    replay(workload, paths, cache, branches=BranchAdmission(min_branches=2, min_reuse=0.5))
    kept_questions = [q for q, (read, _) in zip(questions, paths) if read[-1] in cache]
    # the first wrote the document; two branches off its end never read again: from the fourth on, not cached
    assert kept_questions == questions[:3]
    assert all(read[-1] in cache for read, _ in paths[len(questions):])  # every chat turn is
    assert all(node in cache for node in paths[0][0][:3])  # the document itself stays


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_rule_passes_the_ceiling(seed):
    workload = random_workload(seed)
    for capacity in (60, 200, 600):
        figures = probe(workload, capacity, horizons=(10,))
        assert figures["ceiling"] == pytest.approx(hit_ceiling(workload, capacity))
        for name, hit in figures.items():
            assert 0.0 <= hit <= figures["ceiling"] + 1e-12, name


def test_cli_prints_every_rule_and_the_reuse_table(capsys):
    assert main(["--workload", "shared-prefix", "--replicas", "8", "--budget-tokens", "8000", "--horizon", "50"]) == 0
    out = capsys.readouterr().out
    for name in ("ceiling", "segmented_lru", "s3_fifo", "branch_admission", "lru_oracle_admission_50", "read again"):
        assert name in out
    with pytest.raises(SystemExit):
        main(["--replicas", "8", "--budget-tokens", "8000"])
