"""Precision profiles: what a rollout worker's ``precision`` means for its vLLM engine.

- ``fp32``/``bf16``/``fp16``: the base model in that dtype; the learner sends weights cast to it.
- ``fp8`` with ``quant.fp8.quantize_on: worker`` is vLLM's *online* FP8: the engine loads
  high-precision weights and quantizes them itself, on start-up and again inside every
  ``reload_weights``. On CPU only ``fp8_per_channel`` has a kernel (``fp8``/per-tensor
  needs ``static_scaled_fp8_quant``, missing from the AVX2 build); on CUDA the same
  profile uses ``fp8`` (dynamic per-tensor activations). The CUDA variant is not run here.
- ``fp8`` with ``quant.fp8.quantize_on: learner``: the engine starts from a compressed-tensors FP8
  checkpoint of the base model (written once, cached) and the learner ships per-channel
  fp8 weights plus scales.
- ``int8``: the engine starts from the profile's compressed-tensors INT8 checkpoint
  (``rlpipe calibrate``); the learner ships int8 weights plus scales quantized with the
  profile (calibration transfer).

Each precision's dtype, scheme and online quantization are its row in rlpipe/precisions.py;
the run's ``quant`` section says who quantizes. ``compat`` is what the engine was started
for and what a sync manifest must match (quant/quant_profile.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlpipe.config import QuantConfig
from rlpipe.machine import engine_head_dtype
from rlpipe.precisions import spec


@dataclass(frozen=True)
class PrecisionProfile:
    precision: str  # the label stamped on every record
    dtype: str  # the engine's activation/compute dtype
    quantization: str | None = None  # vLLM's online quantization, if any
    checkpoint: str = ""  # a quantized checkpoint the engine starts from ("" = the base model)
    profile_hash: str = ""  # the quantization profile of that checkpoint
    compat: str = ""  # what a sync manifest's quantization must match ("" = none)
    extra: dict = field(default_factory=dict)

    @property
    def quant_hash(self) -> str:
        """Identifies the quantization in force ("" when there is none)."""
        if self.profile_hash:
            return self.profile_hash
        if self.quantization is None:
            return ""
        blob = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def engine_kwargs(self) -> dict:
        """vLLM arguments of this precision (a run's ``rollout.engine`` may replace ``hf_overrides``:
        rollout_service/engine.py)."""
        kwargs = {"dtype": self.dtype}
        if head := engine_head_dtype(self.dtype):  # a bf16 head is slow on a CPU without native bf16 (rlpipe/machine.py)
            kwargs["hf_overrides"] = {"head_dtype": head}
        if self.quantization:  # (a compressed-tensors checkpoint names its scheme in its config.json)
            kwargs["quantization"] = self.quantization
        return kwargs


def on_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def profile_for(precision: str, cuda: bool | None = None, quant=None, model_path: str = "") -> PrecisionProfile:
    """The engine profile of ``precision`` (its row in rlpipe/precisions.py). ``quant`` (the
    run's QuantConfig; default its defaults) says whether the learner quantizes it, which
    needs the base ``model_path``: the engine then starts from a quantized checkpoint."""
    row = spec(precision)
    quant = QuantConfig() if quant is None else quant
    wire = quant.wire(precision)
    if wire == "int8":
        return _int8_profile(quant.int8, model_path)
    if wire == "fp8":
        return _fp8_profile(model_path)
    cuda = on_cuda() if cuda is None else cuda
    return PrecisionProfile(row.name, row.dtype, row.engine_quantization(cuda))


def _fp8_profile(model_path: str) -> PrecisionProfile:
    """Learner-side fp8: the base model's FP8 checkpoint, for the compat the wire carries."""
    from quant.quant_profile import fp8_identity, model_fingerprint

    compat, profile_hash = fp8_identity(model_fingerprint(model_path))
    return PrecisionProfile("fp8", spec("fp8").dtype, checkpoint=str(fp8_checkpoint(model_path)),
                            profile_hash=profile_hash, compat=compat)


def _int8_profile(int8, model_path: str) -> PrecisionProfile:
    """int8: the profile's checkpoint (``quant.int8``: the run's int8 section)."""
    from quant.quant_profile import load_for_run

    profile = load_for_run(int8, model_path)
    return PrecisionProfile("int8", spec("int8").dtype, checkpoint=str(Path(int8.profile) / "checkpoint"),
                            profile_hash=profile.hash, compat=profile.compat)


def fp8_checkpoint(model_path: str) -> Path:
    """The compressed-tensors FP8 checkpoint of a base model (per-channel weights, dynamic
    per-token activations), written once next to the other cached artifacts."""
    from quant.quant_profile import model_fingerprint, write_checkpoint
    from rlpipe.paths import cache_root

    from quant.int8 import fp8_tensors, quant_config

    # keyed by its quantization_config too, so a checkpoint written with another is not reused
    config = quant_config("fp8")
    version = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    out = cache_root() / "quant" / f"fp8-{model_fingerprint(model_path)}-{version}" / "checkpoint"
    if not (out / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM

        from weight_sync.names import served_parameters

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        write_checkpoint(fp8_tensors(served_parameters(model)), model_path, out, config)
    return out
