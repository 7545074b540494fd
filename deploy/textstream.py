"""Generated token ids → text deltas, with OpenAI stop strings.

Two things make this more than ``decode``: a token may end in the middle of a
UTF-8 character (the byte-level tokenizer does this), and a stop string may
span several tokens. So text is released only once it is final: trailing
replacement characters and any tail that could still begin a stop string are
held back until the next token decides them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class TextStream:
    """Feed token ids with :meth:`push`; each call returns the newly final text.

    ``stopped`` turns true when a stop string appears; the text returned stops
    right before it and later pushes return ``""``. ``text`` is everything
    released so far. Cost: one decode of the whole output per token.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._token_ids: list[int] = []
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._token_ids.append(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """Release whatever is still held back (the output ended)."""
        if self.stopped:
            return ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        decoded = self._decode(self._token_ids)
        search_from = max(0, len(self.text) - self._holdback)
        cut = None
        for stop in self._stop:
            found = decoded.find(stop, search_from)
            if found != -1 and (cut is None or found < cut):
                cut = found
        if cut is not None:
            self.stopped = True
            end = cut
        elif final:
            end = len(decoded)
        else:
            end = len(decoded.rstrip(_REPLACEMENT))
            end = max(len(self.text), end - self._pending_stop_prefix(decoded[:end]))
        delta = decoded[len(self.text) : end]
        self.text += delta
        return delta

    def _pending_stop_prefix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        for length in range(min(self._holdback, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
