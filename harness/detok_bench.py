"""Micro-benchmark: the ingress's detokenization cost per choice, before and
after incremental decoding (deploy/textstream.py).

    python -m harness.detok_bench --tokens 1024 4096 --json results/detok-bench.json

"before" is the previous ``TextStream`` (one decode of the whole output per
token, kept here as :class:`FullDecodeTextStream`); "after" is the current
one. Both stream the same output through the tiny model's tokenizer, token by
token then ``finish()``, as the OpenAI routes do for a streamed or
non-streamed choice; the figure is process CPU seconds per choice (the
ingress's event loop is one thread), best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence

from deploy.textstream import TextStream

_REPLACEMENT = "\ufffd"


class FullDecodeTextStream:
    """The previous algorithm: decode all tokens on every push (O(n²))."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode, self._stop = decode, tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._token_ids: list[int] = []
        self.text, self.stopped = "", False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._token_ids.append(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        decoded = self._decode(self._token_ids)
        search_from = max(0, len(self.text) - self._holdback)
        cut = min((f for f in (decoded.find(s, search_from) for s in self._stop) if f != -1), default=None)
        if cut is not None:
            self.stopped, end = True, cut
        elif final:
            end = len(decoded)
        else:
            end = len(decoded.rstrip(_REPLACEMENT))
            tail = decoded[:end]
            held = next((n for n in range(min(self._holdback, len(tail)), 0, -1)
                         if any(s.startswith(tail[-n:]) for s in self._stop)), 0)
            end = max(len(self.text), end - held)
        delta = decoded[len(self.text) : end]
        self.text += delta
        return delta


def sample_output(tokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    """Text-like output of the byte tokenizer: words, spaces, some multi-byte characters."""
    rng = random.Random(seed)
    words = ["the", "cache", "prefix", "routing", "naïve", "€12", "中文", "😀", "token", "\n"]
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids.extend(tokenizer.encode(rng.choice(words) + " ", add_special_tokens=False))
    return ids[:num_tokens]


def cpu_s_per_choice(stream_class, decode, token_ids, stop: Sequence[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        stream = stream_class(decode, stop)
        for token_id in token_ids:
            stream.push(token_id)
        stream.finish()
        best = min(best, time.process_time() - start)
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from worker.model import byte_tokenizer

    tokenizer = byte_tokenizer()
    rows = []
    for num_tokens in args.tokens:
        token_ids = sample_output(tokenizer, num_tokens)
        for stop in ((), ("<|end|>",)):
            before = cpu_s_per_choice(FullDecodeTextStream, tokenizer.decode, token_ids, stop, args.repeats)
            after = cpu_s_per_choice(TextStream, tokenizer.decode, token_ids, stop, args.repeats)
            rows.append({"num_tokens": num_tokens, "stop_strings": len(stop), "before_cpu_s": round(before, 4),
                         "after_cpu_s": round(after, 4), "speedup": round(before / after, 1)})
            print(json.dumps(rows[-1]))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"rows": rows}, file, indent=2)
    return {"rows": rows}


if __name__ == "__main__":
    main()
