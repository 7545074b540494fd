"""Generated token ids → text deltas, with OpenAI stop strings, in O(output).

Two things make this more than ``decode``: a token may end in the middle of a
UTF-8 character (byte-level tokenizers do this), and a stop string may span
several tokens. So text is released only once it is final: a decode that
ends in a replacement character (or adds nothing) waits for the next token,
and any tail that could still begin a stop string is held back until the
next token decides it.

Decoding is incremental, as in the classic detokenizers (Hugging Face TGI,
vLLM): only a small window of the latest tokens is decoded per push. The
window starts at ``prefix_offset``; the tokens ``[prefix_offset,
read_offset)`` were already released and are decoded again only as context
(a SentencePiece "▁" or a byte sequence reads differently at the start of a
text), so the new text is the window's decode minus that prefix's decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 16  # a window this long that releases nothing is re-based (below)
_REBASE_KEEP_TOKENS = 4  # tokens left undecided by a re-base: a UTF-8 character is at most 4 bytes
_CONTEXT_TOKENS = 4  # already-released tokens decoded again as context


class TextStream:
    """Feed token ids with :meth:`push`; each call returns the newly final text.

    ``stopped`` turns true when a stop string appears; the text returned stops
    right before it and later pushes return ``""``. ``text`` is everything
    released so far; without a stop string, after :meth:`finish` it equals
    ``decode(all token ids)`` for any decoder whose output grows only at its
    end as tokens are appended (byte-level, "▁" and byte-fallback tokenizers
    on what they encode).

    Cost per token: one decode of a window of O(1) tokens (at most
    ``MAX_PENDING_TOKENS`` + context when nothing could be released for a
    while) and a stop-string search over the new text plus the held-back tail.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # window start: context tokens, already released
        self._read_offset = 0  # tokens before this are released
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._pending = ""  # final text held back: it could begin a stop string
        self._released: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        return "".join(self._released)

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._token_ids.append(token_id)
        return self._release(self._new_final_text(), final=False)

    def finish(self) -> str:
        """Release whatever is still held back (the output ended)."""
        if self.stopped:
            return ""
        window = self._decode(self._token_ids[self._prefix_offset :])
        if window.startswith(self._prefix_text):
            new_text = window[len(self._prefix_text) :]
        else:  # a decoder that rewrote released text: fall back to one full decode
            full = self._decode(self._token_ids)
            done = self.text + self._pending
            new_text = full[len(done) :] if full.startswith(done) else ""
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self._prefix_text = ""
        return self._release(new_text, final=True)

    # ------------------------------------------------------------- decoding
    def _new_final_text(self) -> str:
        """Text the latest token made final ("" while a character is incomplete)."""
        window = self._decode(self._token_ids[self._prefix_offset :])
        if len(window) > len(self._prefix_text) and not window.endswith(_REPLACEMENT) and (
            window.startswith(self._prefix_text)
        ):
            new_text = window[len(self._prefix_text) :]
            self._advance(self._read_offset, len(self._token_ids))
            return new_text
        if len(self._token_ids) - self._read_offset > MAX_PENDING_TOKENS:
            return self._rebase(window)
        return ""

    def _advance(self, prefix_offset: int, read_offset: int, prefix_text: str | None = None) -> None:
        self._prefix_offset, self._read_offset = prefix_offset, read_offset
        self._prefix_text = (
            self._decode(self._token_ids[prefix_offset:read_offset]) if prefix_text is None else prefix_text
        )

    def _rebase(self, window: str) -> str:
        """Release all but the last few undecided tokens of a long window
        (e.g. a run of stray continuation bytes, each decoding to nothing or
        to a replacement character), so the window stays short. A split point
        is taken only where decoding both sides apart, with context, gives
        exactly the window's text."""
        tokens = self._token_ids
        for split in range(len(tokens) - _REBASE_KEEP_TOKENS, self._read_offset, -1):
            head = self._decode(tokens[self._prefix_offset : split])
            if not (window.startswith(head) and head.startswith(self._prefix_text)):
                continue
            context_start = max(self._prefix_offset, split - _CONTEXT_TOKENS)
            context = self._decode(tokens[context_start:split])
            rest = self._decode(tokens[context_start:])
            if rest.startswith(context) and head + rest[len(context) :] == window:
                new_text = head[len(self._prefix_text) :]
                self._advance(context_start, split, context)
                return new_text
        return ""

    # ---------------------------------------------------------- stop strings
    def _release(self, new_text: str, final: bool) -> str:
        text = self._pending + new_text
        cut = None
        for stop in self._stop:
            found = text.find(stop)
            if found != -1 and (cut is None or found < cut):
                cut = found
        if cut is not None:
            self.stopped = True
            end = cut
        elif final:
            end = len(text)
        else:
            end = len(text) - self._pending_stop_prefix(text)
        delta, self._pending = text[:end], ("" if cut is not None else text[end:])
        if delta:
            self._released.append(delta)
        return delta

    def _pending_stop_prefix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        for length in range(min(self._holdback, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
