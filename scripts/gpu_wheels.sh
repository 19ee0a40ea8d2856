#!/usr/bin/env bash
# The wheels the GPU device check (python bench/gpu.py --device-check) needs and the device
# machine lacks, into .whl/ (ignored): carry .whl on the device run (docs/gpu.md).
#
# The set is what importing exactly the check's modules (bench/gpu_check.py CHECK_MODULES,
# plus transformers' Qwen2, DCP and torch's CUDA IPC reductions) pulls in beyond the standard
# library, less what the device image already holds (/work/.library/device/KINDS.md's package
# list: torch, transformers, numpy, safetensors, psutil, pyyaml, protobuf, nvidia-ml-py,
# typing-extensions, ...): rlpipe/config.py's pydantic and its own needs. `--probe` prints
# that import list again, to check the set after the imports change.
#
# Versions are those of this checkout's venv, so the dry run here tests what travels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [[ "${1:-}" == "--probe" ]]; then
  exec "$PY" -P -c '
import importlib, sys
sys.path.insert(0, ".")
from bench.gpu_check import CHECK_MODULES
for m in CHECK_MODULES + ("transformers", "torch.distributed.checkpoint", "torch.multiprocessing.reductions"):
    importlib.import_module(m)
from transformers import Qwen2ForCausalLM  # noqa: F401
own = {"bench", "learner", "quant", "weight_sync", "rlpipe", "__main__", "__mp_main__"}
print("\n".join(sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names) - own
                       - {m for m in sys.modules if m.startswith("_")})))'
fi
# typing-extensions too: pydantic needs >= 4.16, and the device's version is not known here.
WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions)
pins=()
for name in "${WHEELS[@]}"; do
  version=$("$PY" -m pip show "$name" | awk '/^Version:/ {print $2}')
  pins+=("$name==$version")
done
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls -l .whl
du -sh .whl
