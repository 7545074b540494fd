"""TextStream releases only final text: whole UTF-8 characters, and nothing
that could still turn into a stop string."""

from deploy.textstream import TextStream


def byte_decode(token_ids):
    return bytes(token_ids).decode("utf-8", errors="replace")


def feed(stream, data: bytes):
    return [stream.push(b) for b in data]


def test_plain_text_is_released_token_by_token():
    stream = TextStream(byte_decode)
    assert feed(stream, b"abc") == ["a", "b", "c"]
    assert stream.finish() == ""
    assert stream.text == "abc"


def test_multibyte_character_is_held_until_complete():
    stream = TextStream(byte_decode)
    euro = "€".encode()  # 3 bytes
    assert feed(stream, euro) == ["", "", "€"]
    assert stream.text == "€"


def test_stop_string_spanning_tokens_cuts_before_it():
    stream = TextStream(byte_decode, stop=["END"])
    deltas = feed(stream, b"hello ENDworld")
    assert "".join(deltas) == "hello "
    assert stream.stopped
    assert stream.text == "hello "
    assert stream.push(ord("x")) == ""


def test_partial_stop_string_is_released_when_it_does_not_complete():
    stream = TextStream(byte_decode, stop=["END"])
    deltas = feed(stream, b"ENx")
    assert "".join(deltas) == "ENx"
    assert not stream.stopped


def test_finish_releases_held_back_tail():
    stream = TextStream(byte_decode, stop=["STOP"])
    deltas = feed(stream, b"abST")
    assert "".join(deltas) == "ab"  # "ST" could still become "STOP"
    assert stream.finish() == "ST"
    assert stream.text == "abST"


def test_earliest_of_several_stop_strings_wins():
    stream = TextStream(byte_decode, stop=["yz", "x"])
    feed(stream, b"abxyz")
    assert stream.text == "ab"


# ------------------------------------------------- incremental = full decode
import random

import pytest


def ignore_decode(token_ids):  # how the tiny model's ByT5 tokenizer decodes bytes
    return bytes(token_ids).decode("utf-8", errors="ignore")


class CountingDecode:
    """A decoder that counts the tokens it was asked to decode."""

    def __init__(self, decode):
        self.decode, self.num_decoded = decode, 0

    def __call__(self, token_ids):
        self.num_decoded += len(token_ids)
        return self.decode(token_ids)


def utf8_heavy_bytes(rng: random.Random, n: int) -> list[int]:
    """Random bytes biased towards multi-byte characters, broken sequences
    and stray continuation bytes (the cases that need holding back)."""
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.3:
            out.append(rng.randrange(32, 127))
        elif kind < 0.7:
            out.extend(rng.choice(["é", "€", "😀", "中", "ß", "\u0301"]).encode())
        elif kind < 0.85:
            out.extend(rng.choice(["€", "😀"]).encode()[: rng.randrange(1, 3)])  # truncated
        else:
            out.append(rng.randrange(128, 256))
    return out[:n]


def run_stream(stream, token_ids, *, chunked=False):
    deltas = [stream.push(t) for t in token_ids]
    deltas.append(stream.finish())
    return deltas


@pytest.mark.parametrize("decode", [byte_decode, ignore_decode], ids=["replace", "ignore"])
@pytest.mark.parametrize("seed", range(40))
def test_incremental_text_equals_a_full_decode_of_random_bytes(decode, seed):
    rng = random.Random(seed)
    token_ids = utf8_heavy_bytes(rng, rng.randrange(1, 400)) if seed % 2 else [rng.randrange(256) for _ in range(300)]
    stream = TextStream(decode)
    deltas = run_stream(stream, token_ids)
    assert "".join(deltas) == stream.text == decode(token_ids)
    for delta in deltas[:-1]:  # nothing released mid-stream is a broken character
        assert not delta.endswith("\ufffd") or decode(token_ids).count("\ufffd")


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_cut_exactly_where_a_full_decode_finds_them(seed):
    rng = random.Random(1000 + seed)
    token_ids = utf8_heavy_bytes(rng, 300)
    full = byte_decode(token_ids)
    stop = ""
    while not stop:  # a client's stop string is real text (no replacement characters)
        stop = full[rng.randrange(50, 250) :].split("\ufffd")[0][: rng.randrange(1, 4)]
    stream = TextStream(byte_decode, stop=[stop, "\x00never"])
    deltas = run_stream(stream, token_ids)
    assert stream.stopped and "".join(deltas) == stream.text == full[: full.find(stop)]


def test_the_tiny_models_tokenizer_streams_its_own_full_decode():
    from worker.model import byte_tokenizer

    tokenizer = byte_tokenizer()
    rng = random.Random(7)
    for _ in range(10):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(500)]  # specials included
        stream = TextStream(tokenizer.decode)
        assert "".join(run_stream(stream, token_ids)) == tokenizer.decode(token_ids)


def _trained_tokenizer(kind: str):
    """A real subword tokenizer trained here (no download): byte-level BPE
    (GPT-2 style) or a Metaspace/"▁" one (SentencePiece/Llama style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [("Déjà vu: the naïve café served crème brûlée for €12 😀. " * 3 + f"line {i} 中文 ") for i in range(200)]
    if kind == "bytelevel":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"] + [f"<0x{b:02X}>" for b in range(256)])
    tokenizer.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_real_subword_tokenizers_stream_their_own_full_decode(kind):
    tokenizer = _trained_tokenizer(kind)
    rng = random.Random(3)
    samples = [tokenizer.encode("Déjà vu: crème brûlée for €12 😀 中文 ok " * 20, add_special_tokens=False)]
    if kind == "bytelevel":  # arbitrary model output: any id in any order
        samples += [[rng.randrange(len(tokenizer)) for _ in range(400)] for _ in range(8)]
    else:  # HF's ByteFallback rewrites earlier bytes once a group turns invalid: arbitrary
        # byte-token orders are not prefix-stable even in a full decode, so output = encoded pieces
        pieces = ["Déjà", " vu", "😀", " 中文", "€", "\u0301", " ok", "ß", "\n", "  x"]
        samples += [sum((tokenizer.encode(rng.choice(pieces), add_special_tokens=False) for _ in range(150)), [])
                    for _ in range(8)]
    for token_ids in samples:
        stream = TextStream(tokenizer.decode)
        assert "".join(run_stream(stream, token_ids)) == tokenizer.decode(token_ids), kind


@pytest.mark.parametrize("decode", [byte_decode, ignore_decode], ids=["replace", "ignore"])
@pytest.mark.parametrize("pattern", ["ascii", "multibyte", "continuation_bytes", "random"])
def test_decoding_work_is_linear_in_the_output(decode, pattern):
    """The ingress decodes O(output) tokens per choice, whatever the output:
    at most a small constant times its length (a full re-decode per token
    would be ~n²/2 = 2M for n = 2,048)."""
    n = 2048
    rng = random.Random(5)
    token_ids = {"ascii": [65 + i % 26 for i in range(n)], "multibyte": list(("€" * n).encode()[:n]),
                 "continuation_bytes": [0x80] * n, "random": [rng.randrange(256) for _ in range(n)]}[pattern]
    counting = CountingDecode(decode)
    stream = TextStream(counting, stop=["STOP!"])
    assert "".join(run_stream(stream, token_ids)) == decode(token_ids)
    assert counting.num_decoded <= 40 * n, counting.num_decoded
