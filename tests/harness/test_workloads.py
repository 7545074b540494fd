"""The one workload module: traces, shared-prefix groups, chats (seeded, pure)."""

from __future__ import annotations

import random

import pytest

from cache import chain_block_keys
from harness.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    TraceBlocks,
    build_workload,
    hot_prefix_prompts,
    multi_turn_chats,
    read_mooncake,
    shared_prefix_prompts,
    zipf_weights,
)

TRACE = "tests/router/data/mooncake_head400.jsonl"


def test_trace_rows_chain_their_full_blocks_and_equal_ids_give_equal_token_prefixes():
    rows = read_mooncake(TRACE, limit=60)
    assert len(rows) == 60
    blocks = TraceBlocks(random.Random(0), tokens_per_block=8)
    prompts = [blocks.prompt(row) for row in rows]
    for row, prompt in zip(rows, prompts):
        num_full = len(row.hash_ids) - (row.num_prompt_tokens < MOONCAKE_BLOCK_TOKENS * len(row.hash_ids))
        assert row.chained_keys() == tuple(chain_block_keys(row.hash_ids[:num_full]))
        assert 8 * (len(row.hash_ids) - 1) < len(prompt) <= 8 * len(row.hash_ids)
    pairs = [(i, j) for i in range(len(rows)) for j in range(i) if rows[i].hash_ids[0] == rows[j].hash_ids[0]]
    assert pairs, "the trace head should repeat prefixes"
    for i, j in pairs:
        ids_i, ids_j = rows[i].hash_ids, rows[j].hash_ids
        limit = min(len(ids_i), len(ids_j)) - 1  # full blocks in both
        common = next((k for k in range(limit) if ids_i[k] != ids_j[k]), limit)
        assert prompts[i][: 8 * common] == prompts[j][: 8 * common]
        if common < limit:
            assert prompts[i][8 * common : 8 * common + 8] != prompts[j][8 * common : 8 * common + 8]


def test_a_bad_trace_row_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n\n'
                    '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: input_length 600 does not fit 1 blocks"):
        read_mooncake(path)
    assert len(read_mooncake(path, limit=1)) == 1


def test_shared_prefix_groups_share_exactly_their_system_prompt_and_are_shuffled():
    prompts = shared_prefix_prompts(random.Random(3), 4, 5, system_tokens=30, question_tokens=6, tokens=(3, 259))
    systems = {p.system for p in prompts}
    assert len(prompts) == 20 and len(systems) == 4
    assert all(sum(p.system == s for p in prompts) == 5 for s in systems)
    assert all(len(p.token_ids) == 36 and all(3 <= t < 259 for t in p.token_ids) for p in prompts)
    assert [p.system for p in prompts] != sorted((p.system for p in prompts), key=[q.system for q in prompts].index)
    assert prompts == shared_prefix_prompts(random.Random(3), 4, 5, 30, 6, tokens=(3, 259))


def test_chats_share_one_system_prompt_and_draw_arrivals_and_answers_only_when_asked():
    live = multi_turn_chats(random.Random(1), 3, 4, system_tokens=10, question_tokens=5)
    assert {c.system for c in live} == {live[0].system} and all(len(c.turns) == 4 for c in live)
    assert all(t.answer == () and t.arrival_s == 0.0 for c in live for t in c.turns)
    simulated = multi_turn_chats(random.Random(1), 3, 4, 10, 5, answer_tokens=7, rate_per_s=2.0, think_s=1.0)
    for chat in simulated:
        arrivals = [t.arrival_s for t in chat.turns]
        assert arrivals == sorted(arrivals) and len(set(arrivals)) == 4
        assert all(len(t.answer) == 7 for t in chat.turns)
    assert simulated[0].turns[0].arrival_s > 0


def test_load_test_sessions_follow_the_presets():
    sessions = build_workload("multi-turn", "cpu", {"num_chats": 3}, None, seed=0)
    assert len(sessions) == 3 and all(len(s.turns) == 4 and len(s.prefix) == 256 for s in sessions)
    mooncake = build_workload("mooncake", "cpu", {"max_requests": 10}, TRACE, seed=0)
    assert len(mooncake) == 10 and all(len(s.prefix) <= 1024 and s.turns[0].question == () for s in mooncake)
    with pytest.raises(ValueError, match="needs --trace"):
        build_workload("mooncake", "cpu", {}, None, seed=0)


def test_documents_are_never_repeated_and_questions_reuse_a_few_system_prompts():
    sessions = build_workload("documents-and-chats", "cpu", {"num_requests": 400}, None, seed=2)
    assert sessions == build_workload("documents-and-chats", "cpu", {"num_requests": 400}, None, seed=2)
    documents = [s.prefix for s in sessions if s.turns[0].question == ()]
    questions = [s for s in sessions if s.turns[0].question != ()]
    assert 160 < len(documents) < 240  # document_share 0.5 of 400
    assert len(set(documents)) == len(documents) and all(len(d) == 1024 for d in documents)
    assert len({s.prefix for s in questions}) == 4 and all(len(s.prefix) == 512 for s in questions)
    assert all(len(s.turns) == 1 and len(s.turns[0].question) == 32 and s.turns[0].max_new_tokens == 4
               for s in questions)
    assert not set(documents) & {s.prefix for s in questions}
    only_documents = build_workload("documents-and-chats", "cpu", {"num_requests": 20, "document_share": 1.0},
                                    None, seed=0)
    assert all(s.turns[0].question == () for s in only_documents)
    with pytest.raises(ValueError, match="document_share"):
        build_workload("documents-and-chats", "cpu", {"document_share": 1.5}, None, seed=0)


def test_zipf_weights_fall_as_rank_to_the_minus_exponent_and_exponent_zero_is_uniform():
    weights = zipf_weights(4, 1.0)
    assert sum(weights) == pytest.approx(1.0)
    assert [w / weights[0] for w in weights] == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4])
    assert zipf_weights(3, 0) == pytest.approx([1 / 3] * 3)
    for bad in ((0, 1.0), (3, -0.5)):
        with pytest.raises(ValueError):
            zipf_weights(*bad)


def test_hot_prefix_popularity_is_skewed_as_zipf_says():
    prompts = hot_prefix_prompts(random.Random(5), 6, 3000, prefix_tokens=8, suffix_tokens=4, zipf_exponent=1.2)
    counts = [sum(p.group == g for p in prompts) for g in range(6)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 4 * counts[-1]
    for count, weight in zip(counts, zipf_weights(6, 1.2)):
        assert abs(count / 3000 - weight) < 0.03  # 3000 draws: ~4 standard errors at the hottest rank
    uniform = hot_prefix_prompts(random.Random(5), 6, 3000, 8, 4, zipf_exponent=0.0)
    assert max(sum(p.group == g for p in uniform) for g in range(6)) < 1.3 * 3000 / 6


def test_hot_prefix_groups_share_their_prefix_token_for_token_and_nothing_else():
    prompts = hot_prefix_prompts(random.Random(2), 4, 200, prefix_tokens=64, suffix_tokens=16, zipf_exponent=1.0,
                                 tokens=(3, 259))
    group_to_prefix = {}
    for p in prompts:
        assert len(p.prefix) == 64 and len(p.suffix) == 16 and p.token_ids == p.prefix + p.suffix
        assert all(3 <= t < 259 for t in p.token_ids)
        assert group_to_prefix.setdefault(p.group, p.prefix) == p.prefix
    assert len(set(group_to_prefix.values())) == len(group_to_prefix) == 4
    assert len({p.suffix for p in prompts}) == len(prompts)  # 16 random tokens: no repeats in 200
    with pytest.raises(ValueError, match="prefix_tokens"):
        hot_prefix_prompts(random.Random(0), 2, 5, 0, 4, 1.0)


def test_hot_prefix_is_reproducible_by_seed_and_its_sessions_follow_the_preset():
    draw = lambda seed: hot_prefix_prompts(random.Random(seed), 5, 50, 32, 8, 1.1)  # noqa: E731
    assert draw(7) == draw(7) and draw(7) != draw(8)
    sessions = build_workload("hot-prefix", "cpu", {"num_requests": 20}, None, seed=3)
    assert sessions == build_workload("hot-prefix", "cpu", {"num_requests": 20}, None, seed=3)
    assert len(sessions) == 20 and all(len(s.prefix) == 1024 and len(s.turns) == 1 for s in sessions)
    assert all(len(s.turns[0].question) == 32 and s.turns[0].max_new_tokens == 8 for s in sessions)
    assert len({s.prefix for s in sessions}) <= 4


def test_rotating_hot_prefix_gives_each_phase_a_new_hot_group():
    import random

    from harness.workloads import build_workload, rotating_hot_prefix_prompts

    prompts = rotating_hot_prefix_prompts(random.Random(3), num_phases=4, requests_per_phase=50, hot_share=0.8,
                                          num_background_groups=2, prefix_tokens=16, suffix_tokens=4)
    assert len(prompts) == 200
    for phase in range(4):
        groups = [p.group for p in prompts[phase * 50:(phase + 1) * 50]]
        assert set(groups) <= {0, 1, 2 + phase}
        assert 30 <= groups.count(2 + phase) <= 48  # ~80 % of the phase
    by_group = {}
    for p in prompts:
        assert by_group.setdefault(p.group, p.prefix) == p.prefix and len(p.suffix) == 4
    assert len(set(by_group.values())) == 6
    sessions = build_workload("rotating-hot-prefix", "cpu", {}, None, 0)
    assert len(sessions) == 64 and all(len(s.prefix) == 1024 for s in sessions)
