from harness.sse import DONE, sse_event, sse_events


def test_data_lines_decode_and_other_lines_carry_nothing():
    assert sse_event('data: {"token_id": 5}\r\n') == {"token_id": 5}
    assert sse_event("data: [DONE]") is DONE
    assert [sse_event(line) for line in ("", ": keep-alive", "event: x")] == [None, None, None]
    assert sse_events('data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n') == [{"a": 1}, {"b": 2}, DONE]
