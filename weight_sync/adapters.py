"""LoRA versions on the worker's side (``learner.lora``): what makes an adapter fit a worker,
and the directory a version is loaded from.

A worker holds its base from the start (the model, or its int8 checkpoint calibrated once)
and never reloads it; a version is an adapter, received over the same gloo buckets as full
weights, with peft's ``adapter_config.json`` in the manifest. vLLM loads adapters from a
directory only (``LoRARequest.lora_path``; there is no public way from memory,
../shared/feasibility/LORA_MOE_NOTES.md), so each version is written to a directory of
its own in ``/dev/shm``, memory and not a shared filesystem, and loaded under a new id:

- a new id per version: re-adding an id silently keeps the old weights;
- a new directory per version: vLLM keys the prefix cache on the adapter's name and path,
  so KV computed under one version is never reused under another;
- a request keeps the adapter it started with (vLLM binds it per request), so a group in
  flight finishes on its version, and the engine removes an old adapter once no request
  holds it (rollout_service/engine.py).

Plain Python without vLLM, like the stager that calls it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from rlpipe.transports import SPECS, either

CONFIG = "adapter_config.json"
TENSORS = "adapter_model.safetensors"
PREFIX = "base_model.model."
ADAPTER = "default"  # peft's name for the one adapter the learner trains
_NAME = re.compile(rf"\.(lora_[AB])\.{ADAPTER}\.")


def wire_tensors(model, gather=None) -> dict[str, torch.Tensor]:
    """A peft model's adapter as peft saves it (``base_model.model.<module>.lora_A.weight``,
    the names vLLM's LoRA loader reads), from its trainable parameters; ``gather(names)``: a
    sharded learner's collective that returns them whole."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    values = gather(names) if gather is not None else dict(model.named_parameters())
    return {saved_name(n): values[n].detach() for n in names}


def saved_name(name: str) -> str:
    """An adapter parameter's name as peft saves it (and vLLM loads it): without the adapter's own name."""
    return _NAME.sub(r".\1.", name)


def wire_config(model) -> str:
    """A peft model's ``adapter_config.json``, as the workers write it beside the tensors."""
    return json.dumps(model.peft_config[ADAPTER].to_dict(), sort_keys=True,
                      default=lambda v: sorted(v) if isinstance(v, set) else str(v))


def base_names(model) -> list[str]:
    """A peft model's base parameter names as the base checkpoint has them (no adapter, no
    ``base_layer``): what the int8 smoothing groups are found from."""
    return [n.removeprefix(PREFIX).replace(".base_layer.", ".") for n, _ in model.named_parameters()
            if ".lora_" not in n]


def module_of(name: str) -> tuple[str, str]:
    """``(base module, lora_A or lora_B)`` of an adapter tensor's peft name."""
    module, part = name.removeprefix(PREFIX).rsplit(".lora_", 1)
    return module, "lora_" + part.split(".", 1)[0]


def adapter_incompatibility(manifest, expected: dict[str, tuple[int, ...]], quant_compat: str, transport: str,
                            quant_profile: str, lora_rank: int) -> str | None:
    """Why an adapter manifest cannot load on a base with the ``expected`` checkpoint shapes,
    started for quantization ``quant_compat`` with profile ``quant_profile``, over ``transport``,
    for adapters up to rank ``lora_rank`` (0: not started for adapters), or None. An int8
    base's adapter is rewritten for its smoothing (quant/int8.py ``smoothed_adapter``), so
    it fits that profile alone: another one is refused, naming both."""
    carriers = [s.name for s in SPECS.values() if s.adapters]
    if transport not in carriers or manifest.transport not in carriers:
        return f"LoRA versions travel over {either(carriers)} only (the learner sends over {manifest.transport})"
    if manifest.quant_compat != quant_compat:
        return (f"the learner's adapter is for a {manifest.quant_compat or 'unquantized'} base, this worker's engine "
                f"holds a {quant_compat or 'unquantized'} one")
    if manifest.quant_profile != quant_profile:
        return (f"the learner's adapter is rewritten for int8 profile {manifest.quant_profile or '-'}, this "
                f"worker's base was quantized with profile {quant_profile or '-'}")
    rank = json.loads(manifest.adapter).get("r", 0)
    if not lora_rank or rank > lora_rank:
        return (f"the learner sends a rank-{rank} adapter, this worker's engine was started for "
                f"{f'ranks up to {lora_rank}' if lora_rank else 'no adapters'} (learner.lora.rank must be alike)")
    for slot in (s for b in manifest.buckets for s in b.tensors):
        module, part = module_of(slot.name)
        base = expected.get(module + ".weight")
        if base is None:
            return f"the learner's adapter has {slot.name!r}, for {module!r}, which this worker's model does not have"
        want = (rank, base[1]) if part == "lora_A" else (base[0], rank)
        if tuple(slot.shape) != want:
            return f"{slot.name}: the learner sends shape {list(slot.shape)}, this worker's {module} takes {list(want)}"
    return None


def adapter_root() -> Path:
    """Where this process writes its versions: ``/dev/shm`` (memory) where there is one."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"rlpipe-adapters-{os.getpid()}"


def write_adapter(tensors: list[tuple[str, torch.Tensor]], config: str, version: int, root: Path | None = None) -> str:
    """Write one version's adapter into a directory of its own; returns its path."""
    from safetensors.torch import save_file

    path = (root or adapter_root()) / f"v{version}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors}, path / TENSORS, metadata={"format": "pt"})
    (path / CONFIG).write_text(config)
    return str(path)


def read_adapter(directory: str | Path) -> tuple[list[tuple[str, torch.Tensor]], str] | None:
    """A checkpoint's adapter (its tensors and config), or None when ``directory`` holds none."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG).is_file():
        return None
    return list(load_file(directory / TENSORS).items()), (directory / CONFIG).read_text()


def remove_adapter(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
