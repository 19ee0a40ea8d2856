"""Precision profiles: what a rollout worker's ``precision`` means for its vLLM engine.

``fp8`` is vLLM's *online* FP8: the engine loads high-precision weights and quantizes
them itself, on start-up and again inside every ``reload_weights``, so a weight update
is re-quantized with fresh per-channel scales. On CPU only ``fp8_per_channel`` has a
kernel (``fp8``/per-tensor needs ``static_scaled_fp8_quant``, missing from the AVX2
build); on CUDA the same profile uses ``fp8`` (dynamic per-tensor activations). The CUDA
variant is not run here.

Quantized CPU engines must run in bfloat16.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PrecisionProfile:
    precision: str  # the label stamped on every record
    dtype: str  # the engine's activation/compute dtype
    quantization: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def quant_hash(self) -> str:
        """Identifies the quantization in force ("" when there is none)."""
        if self.quantization is None:
            return ""
        blob = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def wire_dtype(self) -> str:
        """The dtype the learner should send weights in (the engine quantizes from it)."""
        return self.dtype

    def engine_kwargs(self) -> dict:
        kwargs = {"dtype": self.dtype}
        if self.quantization:
            kwargs["quantization"] = self.quantization
        return kwargs


def on_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def profile_for(precision: str, cuda: bool | None = None) -> PrecisionProfile:
    cuda = on_cuda() if cuda is None else cuda
    if precision == "fp32":
        return PrecisionProfile("fp32", "float32")
    if precision == "bf16":
        return PrecisionProfile("bf16", "bfloat16")
    if precision == "fp16":
        return PrecisionProfile("fp16", "float16")
    if precision == "fp8":
        return PrecisionProfile("fp8", "bfloat16", "fp8" if cuda else "fp8_per_channel")
    raise ValueError(f"precision: unknown value {precision!r} (fp32, bf16, fp16, fp8)")
