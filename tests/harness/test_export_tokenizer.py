"""The exported tokenizer loads with plain ``AutoTokenizer`` and encodes as
the server does (plus ByT5's trailing EOS), chat template included."""

from __future__ import annotations

from transformers import AutoTokenizer

from harness.export_tokenizer import main
from worker.model import byte_tokenizer


def test_an_exported_tokenizer_encodes_as_the_server(tmp_path):
    assert main([str(tmp_path / "tok")]) == 0
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    served = byte_tokenizer()
    for text in ("hello", "Grüße, 世界!", "a\nb"):
        ids = exported.encode(text)
        assert ids[:-1] == served.encode(text) and ids[-1] == served.eos_token_id
        assert exported.decode(ids, skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "Hi"}]
    assert exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        served.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert len(exported) == len(served)


def test_a_checkpoint_holds_the_engines_weights_and_the_plain_tokenizer(tmp_path):
    import torch
    from safetensors.torch import load_file

    from worker.model import TinyLlamaSpec, build_tiny_llama

    assert main([str(tmp_path / "ckpt"), "--with-weights"]) == 0
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    model = build_tiny_llama(TinyLlamaSpec(), vocab_size=len(byte_tokenizer()))
    expected = model.state_dict()
    assert saved and all(torch.equal(tensor, expected[name]) for name, tensor in saved.items())
    assert type(AutoTokenizer.from_pretrained(str(tmp_path / "ckpt"))).__name__.startswith("ByT5")
