"""harness.eviction_bench: the stream it builds, and a small run of both arms on real engines."""

import json

import torch

from harness.eviction_bench import main, make_stream


def test_the_stream_mixes_reused_system_prompts_and_one_off_documents():
    stream = make_stream(200, groups=3, system_tokens=64, question_tokens=8, doc_tokens=128, doc_share=0.5, seed=1)
    assert stream == make_stream(200, 3, 64, 8, 128, 0.5, seed=1)  # seeded
    docs = [p for p in stream if len(p) == 128]
    chats = [p for p in stream if len(p) == 72]
    assert len(docs) + len(chats) == 200 and 70 < len(docs) < 130
    assert len({tuple(p[:64]) for p in chats}) == 3  # three system prompts, reused
    assert len({tuple(p) for p in docs}) == len(docs)  # every document once


def test_segmented_lru_keeps_the_system_prompts_the_documents_push_out_of_plain_lru(tmp_path, capsys):
    out = tmp_path / "eviction.json"
    threads = torch.get_num_threads()
    try:
        code = main(["--requests", "48", "--groups", "2", "--system-tokens", "128", "--question-tokens", "16",
                     "--doc-tokens", "256", "--budget-tokens", "512", "--output-tokens", "2", "--rounds", "1",
                     "--json", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script sets the process's torch threads
    assert code == 0  # the two arms' outputs were identical token for token
    result = json.loads(out.read_text())
    slru, lru = result["summary"]["segmented LRU"], result["summary"]["plain LRU"]
    assert result["outputs_identical"]
    assert slru["hit_rate"] > lru["hit_rate"] + 0.03  # 0.287 against 0.244 on this seeded stream
    assert slru["prefill_tokens"] < lru["prefill_tokens"]
    assert slru["protected_tokens"] > 0 == lru["protected_tokens"]
    assert "segmented / plain: prefill tokens" in capsys.readouterr().out
