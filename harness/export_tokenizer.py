"""The built-in tiny-llama's tokenizer as a directory any Hugging Face client loads.

    python -m harness.export_tokenizer DIR [--with-weights]

Benchmark clients that count tokens themselves (``vllm bench serve
--tokenizer DIR``, aiperf) need the served model's tokenizer, and
``tiny-llama`` is not on the hub. The tokenizer is saved as a plain
``ByT5Tokenizer`` (bytes + pad, eos, unk; the model's chat template), which
``AutoTokenizer.from_pretrained(DIR)`` loads without kvroute installed. It
encodes text to the server's ids, but appends the EOS id as ByT5 does
(kvroute's prompts end where their text ends), so a client counts one
prompt token more than the server.

``--with-weights`` also saves the model (the engine's exact random weights,
float32 safetensors), so a peer server can serve the same model from
``DIR``: ``python -m vllm.entrypoints.openai.api_server --model DIR``.
"""

from __future__ import annotations

import argparse
import sys


def export_tokenizer(directory: str) -> None:
    from worker.model import portable_byte_tokenizer

    portable_byte_tokenizer().save_pretrained(directory)


def export_checkpoint(directory: str) -> None:
    """tiny-llama's weights (``TinyLlamaSpec()``, as the engine builds them) and the tokenizer above."""
    from pathlib import Path

    from worker.model import TinyLlamaSpec
    from worker.vllm_peer import save_checkpoint

    save_checkpoint(TinyLlamaSpec(), Path(directory))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.export_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--with-weights", action="store_true", help="also the model's weights (a whole checkpoint)")
    args = parser.parse_args(argv)
    (export_checkpoint if args.with_weights else export_tokenizer)(args.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
