"""vLLM's offline engine as a benchmark peer, driven over stdin/stdout.

Runs in the vLLM virtual environment (scripts/setup-vllm.sh makes
``.venv-vllm``), never in kvroute's: it imports only vLLM and the standard
library. worker/vllm_peer.py starts it as a subprocess:

    .venv-vllm/bin/python worker/vllm_run.py --model DIR --prompts FILE [--threads 2 ...]

``FILE`` holds ``{"workloads": {name: {"prompts": [[ids...]], "output_tokens": n}}}``.
After start-up (and one untimed warm-up per workload) it prints ``ready``;
then each line ``run NAME`` on stdin clears the prefix cache, runs
``LLM.generate`` on that workload (greedy, EOS ignored, prompts as token
ids) and prints one JSON line (protocol lines start with ``@kvroute ``; vLLM
logs to stdout too): wall seconds, generated and prefill tokens
(prompt tokens minus those vLLM reports as cached), and each request's
token ids. ``quit`` ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


PREFIX = "@kvroute "


def reply(text: str) -> None:
    print(PREFIX + text, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=32, help="vLLM CPU attention: a multiple of 32")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    import torch
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    with open(args.prompts) as f:
        workloads = json.load(f)["workloads"]
    llm = LLM(
        model=args.model, dtype="float32", enable_prefix_caching=True, block_size=args.block_size,
        max_num_batched_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, skip_tokenizer_init=True, seed=0,
    )

    def run(name: str) -> dict:
        workload = workloads[name]
        params = SamplingParams(temperature=0.0, max_tokens=workload["output_tokens"], ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in workload["prompts"]]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        cached = sum(o.num_cached_tokens or 0 for o in outputs)
        return {
            "wall_s": wall_s,
            "generated_tokens": sum(map(len, token_ids)),
            "prefill_tokens": sum(map(len, workload["prompts"])) - cached,
            "token_ids": token_ids,
        }

    for name in workloads:
        run(name)  # warm-up
    reply("ready")
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        if command[0] == "run" and len(command) == 2:
            reply(json.dumps(run(command[1])))
        else:
            reply(json.dumps({"error": f"unknown command {line.strip()!r}"}))


if __name__ == "__main__":
    main()
