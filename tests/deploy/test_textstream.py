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
