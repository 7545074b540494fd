"""vLLM's CPU engine as an optional peer in ``python -m worker.bench --vllm``.

The same random Llama is saved with ``save_pretrained`` (float32
safetensors, plus the byte tokenizer) to a temporary directory; the
workloads' prompts go beside it as token ids. worker/vllm_run.py, started
with the vLLM virtual environment's Python (``.venv-vllm``, made by
scripts/setup-vllm.sh, since vLLM pins its own transformers), loads both
and answers one ``run NAME`` per timed run, so the benchmark can interleave
its runs with ours: both see the same contention on a shared machine.
Between its runs the peer's processes are stopped (SIGSTOP to its process
group, SIGCONT before the next run): vLLM's CPU worker polls for work
while idle and would otherwise take a core from whatever runs meanwhile.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from worker.host import OMP_BINDING
from worker.model import TinyLlamaSpec, build_tiny_llama, byte_tokenizer, portable_byte_tokenizer

DEFAULT_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
RUNNER = Path(__file__).resolve().parent / "vllm_run.py"
PREFIX = "@kvroute "  # worker/vllm_run.py's protocol lines


def save_checkpoint(spec: TinyLlamaSpec, directory: Path) -> None:
    """The random Llama of ``spec`` (the engine's exact weights) and the byte
    tokenizer (as a plain ByT5 one, which any server loads), as a HF checkpoint."""
    model = build_tiny_llama(spec, vocab_size=spec.vocab_size or len(byte_tokenizer()))
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory, safe_serialization=True)
    portable_byte_tokenizer().save_pretrained(directory)


class VllmPeer:
    """A running worker/vllm_run.py; :meth:`run` is one timed ``LLM.generate``."""

    def __init__(
        self, spec: TinyLlamaSpec, workloads: dict[str, dict], *, threads: int, max_batch_tokens: int,
        python: str | os.PathLike | None = None, block_size: int = 32, startup_timeout_s: float = 900.0,
    ) -> None:
        python = Path(python or os.environ.get("KVROUTE_VLLM_PYTHON") or DEFAULT_PYTHON)
        if not python.exists():
            raise FileNotFoundError(f"{python}: run scripts/setup-vllm.sh first (or set KVROUTE_VLLM_PYTHON)")
        self.directory = Path(tempfile.mkdtemp(prefix="kvroute-vllm-"))
        save_checkpoint(spec, self.directory / "model")
        prompts_file = self.directory / "prompts.json"
        prompts_file.write_text(json.dumps({"workloads": workloads}))
        # vLLM pins its own threads (VLLM_CPU_OMP_THREADS_BIND); libgomp's binding stays out of its processes.
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", *OMP_BINDING)}
        env.update(OMP_NUM_THREADS=str(threads), VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
        self.log = open(self.directory / "vllm.log", "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [str(python), str(RUNNER), "--model", str(self.directory / "model"), "--prompts", str(prompts_file),
             "--threads", str(threads), "--max-batch-tokens", str(max_batch_tokens), "--block-size", str(block_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
            cwd=self.directory, start_new_session=True,
        )
        line = self._reply()
        if line != "ready":
            self.close()
            raise RuntimeError(f"vLLM peer did not start (got {line!r}); see {self.directory / 'vllm.log'}")
        self._signal(signal.SIGSTOP)

    def _signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signum)

    def _reply(self) -> str:
        """The next protocol line; vLLM's own output on stdout goes to the log."""
        for line in self.process.stdout:
            if line.startswith(PREFIX):
                return line[len(PREFIX):].strip()
            self.log.write(line)
        return ""

    def run(self, name: str) -> dict:
        """``{"wall_s", "generated_tokens", "prefill_tokens", "token_ids"}`` of one cold-cache run."""
        self._signal(signal.SIGCONT)
        self.process.stdin.write(f"run {name}\n")
        self.process.stdin.flush()
        reply = json.loads(self._reply() or '{"error": "vLLM peer exited"}')
        self._signal(signal.SIGSTOP)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def main() -> None:
    """Smoke check: ``python -m worker.vllm_peer`` runs the tiny model once through vLLM."""
    spec = TinyLlamaSpec()
    workloads = {"smoke": {"prompts": [[5, 6, 7, 8] * 16, [9, 10] * 20], "output_tokens": 4}}
    peer = VllmPeer(spec, workloads, threads=2, max_batch_tokens=512)
    try:
        print(json.dumps(peer.run("smoke")))
    finally:
        peer.close()


if __name__ == "__main__":
    sys.exit(main())
