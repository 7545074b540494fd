#!/usr/bin/env bash
# Create .venv and install kvroute with its test extras. Idempotent.
#
# torch: a plain `pip install torch` on Linux pulls the multi-GB CUDA build.
#   - with an NVIDIA GPU (nvidia-smi works), that is what we want: PyPI's CUDA torch;
#   - on a CPU-only machine we install a CPU torch first: torch==2.13.0 from a
#     local wheel directory when pip's config has one (--no-index --no-deps finds
#     only that; its small dependencies follow from the index), else the CPU
#     wheel index of download.pytorch.org.
#   The package's own `torch` requirement is then already satisfied.
# Override with KVROUTE_TORCH_SPEC (e.g. "torch==2.5.1") or KVROUTE_TORCH_INDEX.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${KVROUTE_TORCH_INDEX:-}" ]; then
    "${PIP[@]}" install "${KVROUTE_TORCH_SPEC:-torch}" --index-url "$KVROUTE_TORCH_INDEX"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing CUDA torch from PyPI"
    "${PIP[@]}" install "${KVROUTE_TORCH_SPEC:-torch}"
  elif "${PIP[@]}" install --no-index --no-deps "${KVROUTE_TORCH_SPEC:-torch==2.13.0}" 2>/dev/null; then
    # The local wheel went in alone; now its dependencies (small, from the index).
    "${PIP[@]}" install "${KVROUTE_TORCH_SPEC:-torch==2.13.0}"
    echo "setup: CPU machine, installed the local CPU torch wheel"
  else
    echo "setup: CPU machine, installing CPU torch from download.pytorch.org/whl/cpu"
    "${PIP[@]}" install "${KVROUTE_TORCH_SPEC:-torch}" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
fi

"${PIP[@]}" install -e ".[test,bench]"
.venv/bin/python -c "import torch, transformers, ray, xxhash; print(f'setup: torch {torch.__version__} (cuda={torch.cuda.is_available()}), transformers {transformers.__version__}, ray {ray.__version__}')"
# Build the optional native CPU kernels now (cached per source, compiler and CPU; the engine
# falls back to its torch kernels where this cannot be done, and says so in its log).
.venv/bin/python -c "import logging; logging.basicConfig(); from worker import native; print('setup: native kernels', 'built' if native.load() else 'unavailable (torch kernels are used)')"
