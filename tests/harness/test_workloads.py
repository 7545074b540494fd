"""The one workload module: traces, shared-prefix groups, chats (seeded, pure)."""

from __future__ import annotations

import random

import pytest

from cache import chain_block_keys
from harness.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    TraceBlocks,
    build_workload,
    multi_turn_chats,
    read_mooncake,
    shared_prefix_prompts,
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
