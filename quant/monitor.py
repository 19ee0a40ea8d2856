"""Monitors of the quantized policy, computed on the learner right after it quantizes an
update (where the full-precision weights are at hand):

- ``quant_saturation_fraction``: weights the profile's calibrated range cannot hold, i.e.
  that would sit at the int8 clamp under the calibrated per-row weight scales. (The scales
  shipped are recomputed per update from each row's amax, so *they* never clip: with them
  exactly one weight per row is at +-127 by construction, which says nothing. What an
  outlier does is outgrow the range the profile's smoothing was balanced for.)
- ``quant_update_visible_fraction``: int8 weights that changed since the previous version;
  an update far below half a quantization step disappears in rounding.
- ``quant_act_clip_fraction``: activations entering quantized linears, on the profile's
  fixed probe set, outside the static input range ``127 * input_scale``. (For dynamic
  activations nothing clips at run time; the figure then says how far the calibrated
  scales are from the current activations.)
- ``quant_kl_vs_bf16``: next-token KL(bf16 policy || quantized policy) on the probe set,
  the quantized forward simulated in torch (fake-quantized weights and activations).

Each comes with its worst linear (``quant_worst``), which the learner's ``/status`` shows.
For the KL the worst linear is the one with the largest relative output error.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from quant.int8 import INT8_MAX, dequantize, quantized_linears, smooth_groups
from quant.quant_profile import QuantProfile
from weight_sync.names import parameter_tensors


def probe_batch(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask)`` of the probe sequences."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def weight_monitors(tensors: dict[str, torch.Tensor], smoothed: dict[str, torch.Tensor], profile: QuantProfile,
                    previous: dict[str, torch.Tensor] | None) -> tuple[dict[str, float], dict[str, dict]]:
    """Saturation and update visibility over every quantized linear; returns
    ``(totals, per_linear)``."""
    sat_n = vis_n = total = 0
    per: dict[str, dict] = {}
    for lin, w in smoothed.items():
        if lin.endswith(".weight"):  # a smoothed norm, not a linear
            continue
        q = tensors[lin + ".weight"]
        ref = profile.weight_amax.get(lin)
        qmax = profile.weight_max
        sat = int((w.abs() > ref.to(w.device)[:, None] * ((qmax + 0.5) / qmax)).sum()) if ref is not None else 0
        vis = int((q != previous[lin + ".weight"]).sum()) if previous is not None else q.numel()
        per[lin] = {"saturation": sat / q.numel(), "visible": vis / q.numel()}
        sat_n, vis_n, total = sat_n + sat, vis_n + vis, total + q.numel()
    totals = {"quant_saturation_fraction": sat_n / max(total, 1)}
    if previous is not None:
        totals["quant_update_visible_fraction"] = vis_n / max(total, 1)
    return totals, per


def fake_quant(x: torch.Tensor, profile: QuantProfile, linear: str) -> torch.Tensor:
    """``x`` (the smoothed input of ``linear``) as the int8 engine quantizes it: static
    per-tensor with the profile's scale, or dynamic per-token."""
    if profile.static:
        s = torch.tensor(profile.input_scales[linear])
    else:
        s = (x.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(min=1e-12)
    return torch.round(x / s).clamp(-128, 127) * s


# Tokens the output error is computed on (evenly spaced over the valid ones): it only ranks the linears to
# name the worst, and on every probe token its two extra matmuls per linear cost a third of the monitors
# (SmolLM2, 32 probe rows, one core: 43-46 s a monitored update, 32 s with this; the two forwards are the rest).
ERROR_TOKENS = 256


def input_stats(x: torch.Tensor, xq: torch.Tensor, exact_w: torch.Tensor, quantized_w: torch.Tensor,
                profile: QuantProfile, linear: str) -> dict:
    """One quantized linear on its (valid, smoothed) inputs ``x``, fake-quantized ``xq``:
    the fraction outside the static range (every token), and the output's relative error
    against the unquantized smoothed weights ``exact_w`` (on ``ERROR_TOKENS`` of them, evenly spaced)."""
    n_clipped = int((x.abs() > INT8_MAX * profile.input_scales.get(linear, float("inf"))).sum())
    n_inputs = x.numel()
    every = -(-x.shape[0] // ERROR_TOKENS)  # ceil: at most ERROR_TOKENS rows, spread over every probe row
    x, xq = x[::every], xq[::every]
    exact = F.linear(x, exact_w)
    err = (F.linear(xq, quantized_w) - exact).norm() / exact.norm().clamp(min=1e-12)
    return {"act_clip": n_clipped / max(n_inputs, 1), "clipped": n_clipped, "inputs": n_inputs,
            "output_error": float(err)}


@torch.no_grad()
def simulate(model, tensors: dict[str, torch.Tensor], smoothed: dict[str, torch.Tensor], profile: QuantProfile,
             input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, dict]]:
    """Logits of the quantized policy on a batch, simulated in fp32: weights dequantized
    from ``tensors``, every quantized linear's input fake-quantized (static per-tensor with
    the profile's scale, or dynamic per-token). Also returns, per linear, the fraction of
    its (valid-token) inputs outside the static range and its relative output error
    against the unquantized smoothed weights."""
    from torch.func import functional_call

    weights = parameter_tensors(model, dequantize(tensors))  # served names -> the model's (MoE experts)
    valid = attention_mask.bool()
    stats: dict[str, dict] = {}
    hooks = []

    def hook_for(name: str):
        def pre_hook(module, args):
            (x,) = args
            xq = fake_quant(x.float(), profile, name)
            stats[name] = input_stats(x.float()[valid], xq[valid], smoothed[name], module.weight.float(), profile,
                                      name)
            return (xq.to(x.dtype),)

        return pre_hook

    modules = dict(model.named_modules())
    for name in smoothed:
        if not name.endswith(".weight"):
            hooks.append(modules[name].register_forward_pre_hook(hook_for(name)))
    try:
        logits = functional_call(model, weights, (input_ids,), {"attention_mask": attention_mask}).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits, stats


@torch.no_grad()
def next_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor, attention_mask: torch.Tensor) -> float:
    """Mean over valid positions of KL(softmax(ref) || softmax(logits))."""
    ref = torch.log_softmax(ref_logits.float(), -1)
    other = torch.log_softmax(logits.float(), -1)
    kl = (ref.exp() * (ref - other)).sum(-1)
    return float(kl[attention_mask.bool()].mean())


@torch.no_grad()
def bf16_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The policy with its weights rounded to bf16 (what a bf16 engine serves), in fp32 math."""
    from torch.func import functional_call

    params = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
    return functional_call(model, params, (input_ids,), {"attention_mask": attention_mask}).logits.float()


def monitor(model, tensors: dict[str, torch.Tensor], smoothed: dict[str, torch.Tensor], profile: QuantProfile,
            previous: dict[str, torch.Tensor] | None) -> dict:
    """Every monitor for one quantized update; ``quant_worst`` names each one's worst linear."""
    totals, per = weight_monitors(tensors, smoothed, profile, previous)
    if profile.probe_ids:
        ids, mask = probe_batch(profile.probe_ids)
        logits, act = simulate(model, tensors, smoothed, profile, ids, mask)
        totals["quant_kl_vs_bf16"] = next_token_kl(bf16_logits(model, ids, mask), logits, mask)
        totals["quant_act_clip_fraction"] = sum(s["clipped"] for s in act.values()) / max(
            sum(s["inputs"] for s in act.values()), 1)
        for lin, s in act.items():
            per[lin].update(act_clip=s["act_clip"], output_error=s["output_error"])
    return {**totals, "quant_worst": worst_linears(per, totals)}


def worst_linears(per: dict[str, dict], totals: dict) -> dict:
    """Each reported monitor's worst linear. The largest relative output error stands for
    the KL (``quant_kl_vs_bf16``), or for itself where no KL was computed (a layer sample)."""
    error = "quant_kl_vs_bf16" if "quant_kl_vs_bf16" in totals else "output_error"
    worst = {}
    for key, metric in (("saturation", "quant_saturation_fraction"), ("visible", "quant_update_visible_fraction"),
                        ("act_clip", "quant_act_clip_fraction"), ("output_error", error)):
        have = {lin: s[key] for lin, s in per.items() if key in s}
        if have and (metric in totals or metric == "output_error"):
            lin = max(have, key=have.get) if key != "visible" else min(have, key=have.get)
            worst[metric] = {"linear": lin, key: round(have[lin], 6)}
    return worst


def sample_linears(names: Iterable[str], layers: int) -> list[str]:
    """The quantized linears of ``layers`` decoder layers spread evenly over the model, the
    first and the last among them (outliers grow at both ends)."""
    linears = quantized_linears(names)
    prefixes = list(dict.fromkeys(lin.rsplit(".", 2)[0] for lin in linears))  # model.layers.N, in order
    n, k = len(prefixes), min(layers, len(prefixes))
    picked = {prefixes[round(i * (n - 1) / max(k - 1, 1))] for i in range(k)}
    return [lin for lin in linears if lin.rsplit(".", 2)[0] in picked]


@torch.no_grad()
def sampled_monitor(model, gather, forward, profile: QuantProfile, previous: dict[str, torch.Tensor] | None,
                    names: list[str], layers: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The monitors on a sample of the decoder layers (:func:`sample_linears`), for a sharded
    learner, where no rank holds the whole model. One sampled layer at a time:
    ``gather(names)`` gathers its linears' weights whole, and ``forward(input_ids,
    attention_mask)`` runs the policy on the probe set on every rank while hooks here
    measure each of its linears on its real inputs (smoothed by the profile). Rank 0 holds
    one layer's weights at a time for it, and the sample's int8 weights (on the host) for
    the next update's visibility, which this returns beside the metrics.

    Saturation and visibility are exact on the sample. Activation clipping is measured on
    the policy's own activations rather than on those of the quantized policy, whose
    earlier layers would already be quantized; ``quant_kl_vs_bf16`` needs a forward of the
    whole quantized model and is not computed (each linear's output error stands in)."""
    by_layer: dict[str, list[str]] = {}
    for lin in sample_linears(names, layers):
        by_layer.setdefault(lin.rsplit(".", 2)[0], []).append(lin)
    per: dict[str, dict] = {}
    weights_seen = saturated = changed = 0
    clipped = inputs = 0
    kept = {}
    for linears in by_layer.values():
        tensors, smoothed = profile.int8_tensors(gather([lin + ".weight" for lin in linears]), names)
        ints = {k: v.cpu() for k, v in tensors.items() if v.dtype == torch.int8}
        _, layer = weight_monitors(ints, smoothed, profile, previous)
        for lin, m in layer.items():
            n = ints[lin + ".weight"].numel()
            weights_seen, saturated, changed = weights_seen + n, saturated + m["saturation"] * n, changed + m["visible"] * n
        per.update(layer)
        kept.update(ints)
        if profile.probe_ids:
            act = _probe_layer(model, forward, profile, names, linears, tensors, smoothed)
            clipped += sum(s["clipped"] for s in act.values())
            inputs += sum(s["inputs"] for s in act.values())
            for lin, s in act.items():
                per[lin].update(act_clip=s["act_clip"], output_error=s["output_error"])
    totals = {"quant_saturation_fraction": round(saturated) / max(weights_seen, 1)}
    if previous is not None:
        totals["quant_update_visible_fraction"] = round(changed) / max(weights_seen, 1)
    if profile.probe_ids:
        totals["quant_act_clip_fraction"] = clipped / max(inputs, 1)
    layers_seen = sorted(int(prefix.rsplit(".", 1)[1]) for prefix in by_layer)
    return {**totals, "quant_worst": worst_linears(per, totals), "quant_monitor_layers": layers_seen}, kept


def _probe_layer(model, forward, profile: QuantProfile, names: list[str], linears: list[str], tensors,
                 smoothed) -> dict:
    """Each of ``linears`` (one layer's) on the probe set: hooks on them while ``forward`` runs."""
    modules = dict(model.named_modules())
    ids, mask = probe_batch(profile.probe_ids)
    divisor = {lin: profile.smoothing[g.norm].float() for g in smooth_groups(names) for lin in g.linears}
    act: dict[str, dict] = {}

    def hook_for(lin: str):
        def pre_hook(module, args):
            x = args[0].detach()[mask.bool().to(args[0].device)].float()
            x = x / divisor[lin].to(x.device) if lin in divisor else x
            quantized_w = tensors[lin + ".weight"].float() * tensors[lin + ".weight_scale"]  # as the engine computes
            act[lin] = input_stats(x, fake_quant(x, profile, lin), smoothed[lin].to(x.device),
                                   quantized_w.to(x.device), profile, lin)

        return pre_hook

    hooks = [modules[lin].register_forward_pre_hook(hook_for(lin)) for lin in linears]
    try:
        forward(ids, mask)
    finally:
        for h in hooks:
            h.remove()
    return act
