"""The systems worker/bench.py times against this engine, on the same weights.

Each peer has ``name`` and ``once(workload) -> Outcome``: one cold-start run
of the whole workload (all prompts at once, greedy, EOS ignored, the
workload's output length each).

- :class:`StaticBatchSystem`: transformers' ``model.generate`` on all
  prompts as one padded batch (left padding; the prompts of our workloads
  have equal lengths, so nothing is padded);
- :class:`ContinuousBatchingSystem`: transformers' ``generate_batch``
  (paged cache with block sharing);
- :class:`PlainGenerateSystem`: ``model.generate`` one request at a time;
- :class:`VllmSystem`: vLLM's CPU engine, offline ``LLM.generate`` with
  prefix caching, in its own virtual environment (worker/vllm_peer.py);
  its wall time is measured inside that process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model import TinyLlamaSpec, build_tiny_llama, byte_tokenizer


@dataclass(frozen=True, slots=True)
class Outcome:
    """One run's results: generated token ids per prompt (in prompt order)."""

    token_ids: list[list[int]]
    prefill_tokens: int | None = None  # tokens the system ran through prefill, where it reports them
    wall_s: float | None = None  # measured by the system itself (another process); else timed by the caller
    logprobs: list[list[float]] | None = None


def hf_model(spec: TinyLlamaSpec):
    model = build_tiny_llama(spec, vocab_size=spec.vocab_size or len(byte_tokenizer())).eval()
    model.requires_grad_(False)
    return model


class StaticBatchSystem:
    name = "transformers generate (static batch)"

    def __init__(self, spec: TinyLlamaSpec) -> None:
        self.model = hf_model(spec)
        with torch.inference_mode():
            self.model.generate(torch.tensor([[5, 6, 7, 8] * 8]), max_new_tokens=2, do_sample=False, pad_token_id=0)

    def once(self, workload) -> Outcome:
        width = max(map(len, workload.prompts))
        ids = torch.zeros(len(workload.prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(workload.prompts):  # left padding
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        out = self.model.generate(
            ids, attention_mask=mask, max_new_tokens=workload.output_tokens, min_new_tokens=workload.output_tokens,
            do_sample=False, pad_token_id=0,
        )
        return Outcome([row[width:].tolist() for row in out], prefill_tokens=sum(map(len, workload.prompts)))


class ContinuousBatchingSystem:
    """transformers' continuous batching, paged cache with block sharing (page size 16,
    the fastest of the settings tried; its defaults were about 2x slower here)."""

    name = "transformers generate_batch"

    def __init__(self, spec: TinyLlamaSpec, *, max_batch_tokens: int, output_tokens: int) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model = hf_model(spec)
        self.generation = GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        self.cb_config = ContinuousBatchingConfig(
            page_size=16, num_blocks=4096, max_batch_tokens=max_batch_tokens, max_requests_per_batch=64,
            allow_block_sharing=True,
        )
        with torch.inference_mode():
            self._generate([[5, 6, 7, 8] * 8])

    def _generate(self, prompts):
        return self.model.generate_batch(prompts, generation_config=self.generation, continuous_batching_config=self.cb_config)

    def once(self, workload) -> Outcome:
        outputs = self._generate(workload.prompts)
        ordered = [outputs[key] for key in sorted(outputs, key=lambda k: int(str(k).rsplit("_", 1)[-1]))]
        return Outcome([list(o.generated_tokens) for o in ordered])


class PlainGenerateSystem:
    name = "transformers generate (one by one)"

    def __init__(self, spec: TinyLlamaSpec) -> None:
        self.model = hf_model(spec)
        with torch.inference_mode():
            self.model.generate(torch.tensor([[5, 6, 7, 8] * 8]), max_new_tokens=2, do_sample=False, pad_token_id=0)

    def once(self, workload) -> Outcome:
        kwargs = dict(max_new_tokens=workload.output_tokens, min_new_tokens=workload.output_tokens,
                      do_sample=False, pad_token_id=0)
        token_ids = [self.model.generate(torch.tensor([p]), **kwargs)[0, len(p):].tolist() for p in workload.prompts]
        return Outcome(token_ids, prefill_tokens=sum(map(len, workload.prompts)))


class VllmSystem:
    name = "vLLM CPU (LLM.generate)"

    def __init__(self, spec: TinyLlamaSpec, workloads: dict, *, threads: int, max_batch_tokens: int) -> None:
        from worker.vllm_peer import VllmPeer

        self.peer = VllmPeer(
            spec, {name: {"prompts": w.prompts, "output_tokens": w.output_tokens} for name, w in workloads.items()},
            threads=threads, max_batch_tokens=max_batch_tokens,
        )
        self.names = {id(w): name for name, w in workloads.items()}

    def once(self, workload) -> Outcome:
        reply = self.peer.run(self.names[id(workload)])
        return Outcome(reply["token_ids"], prefill_tokens=reply["prefill_tokens"], wall_s=reply["wall_s"])

    def close(self) -> None:
        self.peer.close()
