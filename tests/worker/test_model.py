import hashlib
import subprocess
import sys

import pytest
import torch

from worker.model import TinyLlamaSpec, build_tiny_llama, byte_tokenizer, load_model, model_info


def _weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def test_tiny_llama_has_the_same_weights_in_every_process():
    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=96, num_layers=1)
    here = _weights_digest(build_tiny_llama(spec, vocab_size=259))
    code = (
        "import hashlib\n"
        "from worker.model import TinyLlamaSpec, build_tiny_llama\n"
        "spec = TinyLlamaSpec(hidden_size=64, intermediate_size=96, num_layers=1)\n"
        "model = build_tiny_llama(spec, vocab_size=259)\n"
        "digest = hashlib.sha256()\n"
        "for name, tensor in sorted(model.state_dict().items()):\n"
        "    digest.update(name.encode()); digest.update(tensor.detach().cpu().numpy().tobytes())\n"
        "print(digest.hexdigest())\n"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there
    assert _weights_digest(build_tiny_llama(TinyLlamaSpec(hidden_size=64, intermediate_size=96, num_layers=1, seed=1), 259)) != here


def test_building_the_model_leaves_the_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_tiny_llama(TinyLlamaSpec(hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1), 259)
    assert torch.equal(torch.rand(3), expected)


def test_byte_tokenizer_round_trips_and_appends_no_eos():
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("héllo")
    assert ids == [b + 3 for b in "héllo".encode()]
    assert tokenizer.decode(ids) == "héllo"
    assert len(tokenizer) == 259 and tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>hi\n<|assistant|>"


def test_load_model_reports_geometry_and_routes_attention():
    loaded = load_model("tiny-llama", TinyLlamaSpec(), device="cpu", dtype="float32", attn_implementation="sdpa")
    assert loaded.vocab_size == 259 and loaded.eos_token_ids == (1,) and loaded.pad_token_id == 0
    assert (loaded.geometry.num_layers, loaded.geometry.num_kv_heads, loaded.geometry.head_dim) == (2, 2, 32)
    assert loaded.model.config._attn_implementation == "sdpa"


def test_model_info_without_weights():
    info = model_info("tiny-llama", {"max_model_len": 512})
    assert info == {"model_id": "tiny-llama", "vocab_size": 259, "max_model_len": 512, "eos_token_id": 1, "eos_token_ids": [1]}
    assert model_info("tiny-llama", {"tiny_llama": {"max_position_embeddings": 300}})["max_model_len"] == 300


def _save_random_model(tmp_path, family: str):
    import transformers

    common = dict(
        vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, pad_token_id=0,
    )
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = model_class(config_class(**common))
    path = tmp_path / family
    model.save_pretrained(path)
    _fast_tokenizer().save_pretrained(path)
    return str(path)


def _fast_tokenizer():
    """A 259-token word-level fast tokenizer (what AutoTokenizer loads for every family)."""
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"t{i}": i + 3 for i in range(256)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_hf_models_from_a_local_path_match_their_plain_server(tmp_path, family, make_engine, tokens):
    from worker import reference

    path = _save_random_model(tmp_path, family)
    engine = make_engine(model=path, max_model_len=512)
    assert engine.vocab_size == 259 and engine.max_model_len == 512
    system = tokens(40)
    prompts = [system + tokens(5 + i) for i in range(3)]
    outputs = engine.generate_batch(prompts, 6, logprobs=True)
    for prompt, output in zip(prompts, outputs):
        assert output == reference.generate(engine, prompt, 6, logprobs=True)
    assert engine.stats["hits"] == 2
