"""Each rollout precision, defined once.

A precision is one row of :data:`SPECS`. Everything else is derived from it: the config's
``Precision`` type, the wire schema's ``PRECISIONS``, the engine profile
(quant/precision_profile.py ``profile_for``) and the learner's wire (quant/transfer.py
``rollout_weights``), both through :class:`rlpipe.config.QuantConfig`'s ``wire`` for a
precision with a quantization scheme. Adding a precision is adding a row here (and its wire
class, if it is quantized on the learner): no other list of precisions exists to forget.

Kept free of heavy imports (no torch, no pydantic): the wire schema reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PrecisionSpec:
    name: str  # the label on every record, registered worker and sync channel
    # The engine's compute dtype (a torch dtype's name), and the dtype the learner casts the
    # weights it sends to when it does not quantize them itself.
    dtype: str
    # The quantization scheme, whose settings are the run's ``quant.<scheme>`` section; "" = none.
    scheme: str = ""
    # vLLM's online quantization when the engine quantizes the weights itself (on CUDA, on
    # CPU: the AVX2 build has only the per-channel FP8 kernel); None = the engine does not.
    online: tuple[str, str] | None = None

    def engine_quantization(self, cuda: bool) -> str | None:
        """vLLM's ``quantization`` for an engine that quantizes the weights itself, or None."""
        return None if self.online is None else self.online[0 if cuda else 1]


# fp32 is not in docs/design.md's list; it is the exact-reference precision the log-prob tests use.
SPECS: dict[str, PrecisionSpec] = {s.name: s for s in (
    PrecisionSpec("fp32", "float32"),
    PrecisionSpec("bf16", "bfloat16"),
    PrecisionSpec("fp16", "float16"),
    # Quantized CPU engines must run in bfloat16.
    PrecisionSpec("fp8", "bfloat16", scheme="fp8", online=("fp8", "fp8_per_channel")),
    PrecisionSpec("int8", "bfloat16", scheme="int8"),
)}
PRECISIONS: tuple[str, ...] = tuple(SPECS)
Precision = Literal[PRECISIONS]  # the config's type: pydantic refuses any other value, naming the key
# How the learner sends a precision's weights: cast to its dtype, or quantized by the learner
# with the scheme (quant/transfer.py: CastWeights, Fp8Weights, Int8Weights).
WireKind = Literal["cast", "fp8", "int8"]


def spec(precision: str) -> PrecisionSpec:
    """The row of ``precision``; a ValueError naming the key for any other value."""
    try:
        return SPECS[precision]
    except KeyError:
        raise ValueError(f"rollout.precision: unknown value {precision!r} ({', '.join(PRECISIONS)})") from None
