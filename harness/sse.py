"""Reading the app's server-sent events: ``data: <json>`` lines, the stream
ending with ``data: [DONE]`` (the one parser the load test, the retry client
and the tests share)."""

from __future__ import annotations

import json

DONE = "[DONE]"


def sse_event(line: str) -> dict | str | None:
    """What one line of a stream carries: its JSON object, :data:`DONE` for
    the end marker, or None for a line with no data (blank, comment, other field)."""
    line = line.rstrip("\r\n")
    if not line.startswith("data: "):
        return None
    payload = line[len("data: "):]
    return DONE if payload == DONE else json.loads(payload)


def sse_events(text: str) -> list[dict | str]:
    """Every event of a whole stream's text, in order."""
    return [event for event in map(sse_event, text.splitlines()) if event is not None]
