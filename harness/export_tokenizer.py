"""The built-in tiny-llama's tokenizer as a directory any Hugging Face client loads.

    python -m harness.export_tokenizer DIR

Benchmark clients that count tokens themselves (``vllm bench serve
--tokenizer DIR``, aiperf) need the served model's tokenizer, and
``tiny-llama`` is not on the hub. The tokenizer is saved as a plain
``ByT5Tokenizer`` (bytes + pad, eos, unk; the model's chat template), which
``AutoTokenizer.from_pretrained(DIR)`` loads without kvroute installed. It
encodes text to the server's ids, but appends the EOS id as ByT5 does
(kvroute's prompts end where their text ends), so a client counts one
prompt token more than the server.
"""

from __future__ import annotations

import argparse
import sys


def export_tokenizer(directory: str) -> None:
    from transformers import ByT5Tokenizer

    from worker.model import BYTE_CHAT_TEMPLATE

    tokenizer = ByT5Tokenizer(extra_ids=0)
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.export_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    export_tokenizer(parser.parse_args(argv).directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
