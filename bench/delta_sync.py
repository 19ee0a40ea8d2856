"""Delta weight sync, measured over the updates of a real run: the bytes each sync would
send as deltas against the version a worker holds (weight_sync/delta_codec.py), against the full int8
wire and against bf16, and what encoding and applying them costs.

The versions are those of a short int8 ``rlpipe demo`` (the toy task, the demo's learning
rate and schedule) that checkpoints every step: a checkpoint keeps the int8 tensors of its
version exactly as they were sent (``rollout/int8/``, learner/checkpoint.py), and its
policy weights, from which the bf16 wire (the weights cast) and the learner-side fp8 wire
(quant/int8.py ``fp8_tensors``) of the same version are made. Version 0 is the toy model
quantized with the run's profile (checked against what the checkpoints hold).

Per sync v-1 -> v, for each wire: full bytes, delta bytes, delta / full, and for int8 the
share of int8 weights changed (the learner's own ``quant_update_visible_fraction`` beside
it), the encodings chosen, and the time split (1 thread): encode (compare, pick, pack,
with both checksums), apply in place into the held tensors with the checksums checked, and
the same apply unchecked. Also int8 in the other weight range (``quant.int8.weights``: 8-bit,
or 7-bit on CPUs without VNNI), re-quantized here from the same weights.

    python bench/delta_sync.py                         # 12 steps, 16 groups per step (a few minutes)
    python bench/delta_sync.py --quick --json /tmp/delta_sync.json
    python bench/delta_sync.py --from-run runs/delta_sync/delta-int8   # measure a kept run again

``--quick`` trains nothing when ``--reuse`` names an int8 run with a checkpoint at every
step (``rlpipe bench --quick`` passes the int8 seed's quick run, which keeps them): starting
the engines of a run of its own would cost the quick bench about 40 s more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402

QUICK = {"steps": 3, "groups": 8}


def say(msg: str) -> None:
    print(f"[delta_sync] {msg}", file=sys.stderr, flush=True)


def train(steps: int, groups: int | None, out: Path, config: str | None = None, rid: str = "delta-int8") -> Path:
    """A whole int8 demo run that keeps every version's checkpoint; returns its run dir.
    ``config``: a recipe's file (the real model's), the demo's own without; ``groups``: its
    ``learner.groups_per_step`` (None: the recipe's)."""
    import shutil

    import yaml

    from launch.demo import run_demo
    from rlpipe.config import build_config

    shutil.rmtree(out / rid, ignore_errors=True)  # a kept run dir would be resumed, not trained anew
    base = yaml.safe_load(Path(config).read_text()) if config else {}
    cfg = build_config(base, environ={}, seed=0, run_id=rid, steps=steps, workers=1,
                       **{"rollout.precision": "int8", "learner.checkpoint_every": 1, "learner.checkpoint_keep": 10_000,
                          "eval.every": 0, **({"learner.groups_per_step": groups} if groups else {})})
    t0 = time.time()
    run_demo(cfg, runs_dir=str(out), progress=False, timeout_s=3600)
    say(f"trained {steps} steps in {time.time() - t0:.0f}s")
    return out / rid


def reusable(run: Path) -> bool:
    """An int8 run with the checkpoint of version 1 (so at least the sync 0 -> 1 to measure)."""
    import yaml

    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
    except OSError:
        return False
    return cfg["rollout"]["precision"] == "int8" and (run / "checkpoints" / "step_00000001").is_dir()


def versions(run: Path):
    """``(version, weights, int8 wire)`` from version 0 (the base model, quantized here) on."""
    import torch
    import yaml
    from safetensors.torch import load_file

    from quant.quant_profile import QuantProfile

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    profile = QuantProfile.load(cfg["quant"]["int8"]["profile"])
    base = {n: t.float() for n, t in load_file(Path(cfg["model"]["path"]) / "model.safetensors").items()}
    yield 0, base, profile.int8_tensors(base)[0], profile
    for ck in sorted((run / "checkpoints").glob("step_*")):
        weights = load_file(ck / "model.safetensors")
        int8 = load_file(ck / "rollout" / "int8" / "model.safetensors")
        again = profile.int8_tensors(weights)[0]
        if set(again) != set(int8) or any(not torch.equal(again[n], int8[n]) for n in int8):
            raise SystemExit(f"{ck}: the run's profile does not give the int8 tensors it sent")
        yield int(json.loads((ck / "meta.json").read_text())["version"]), weights, int8, profile


def wires(weights, int8, profile) -> dict:
    """Every wire of one version: int8 as sent, int8 in the other weight range, learner fp8, bf16."""
    import torch

    from quant.int8 import WEIGHT_MAX, fp8_tensors, int8_tensors

    other = "int8-w7a8" if profile.weight_max == WEIGHT_MAX["int8-w8a8"] else "int8-w8a8"
    bits = 7 if other == "int8-w7a8" else 8
    other_range = int8_tensors(weights, profile.smoothing, profile.input_scales if profile.static else None,
                               weight_max=WEIGHT_MAX[other])[0]
    return {"int8": int8, f"int8 ({bits}-bit weights)": other_range, "fp8": fp8_tensors(weights),
            "bf16": {n: t.to(torch.bfloat16) for n, t in weights.items()}}


def measure(run: Path, repeats: int) -> list[dict]:
    import torch

    from learner.metrics import read_jsonl
    from weight_sync.delta_codec import apply_, encode_all, totals

    torch.set_num_threads(1)
    learner_visible = {r["step"]: r.get("quant_update_visible_fraction") for r in read_jsonl(run / "metrics.jsonl")}
    rows, held, held_version = [], None, None
    for version, weights, int8, profile in versions(run):
        now = wires(weights, int8, profile)
        if held is not None and version == held_version + 1:  # a sync is one version's step
            for wire, new in now.items():
                base = held[wire]
                deltas = encode_all(base, new)
                t = totals(deltas)
                row = {"version": version, "wire": wire, "full_bytes": t["full_bytes"], "delta_bytes": t["delta_bytes"],
                       "ratio": t["ratio"], "encodings": t["encodings"]}
                weights8 = [n for n, x in new.items() if x.dtype in (torch.int8, torch.float8_e4m3fn)]
                if weights8:
                    changed = sum(int((new[n].view(torch.uint8) != base[n].view(torch.uint8)).sum()) for n in weights8)
                    row["visible"] = changed / sum(new[n].numel() for n in weights8)
                if wire == "int8":
                    row["learner_visible"] = learner_visible.get(version)
                if wire != "bf16":  # time the quantized wires (bf16 is for its bytes)
                    held_copies = [{n: x.clone() for n, x in base.items()} for _ in range(repeats)]
                    crcs = {n: d.base_crc for n, d in deltas.items()}
                    row["encode_s"] = timed(lambda: encode_all(base, new), repeats)
                    copies = iter(held_copies)
                    row["apply_s"] = timed(lambda: [apply_(h[n], d, held_crc=crcs[n])
                                                    for h in [next(copies)] for n, d in deltas.items()], repeats)
                    copies = iter([{n: x.clone() for n, x in base.items()} for _ in range(repeats)])
                    row["apply_unchecked_s"] = timed(lambda: [apply_(h[n], d, verify=False)
                                                              for h in [next(copies)] for n, d in deltas.items()],
                                                     repeats)
                rows.append(row)
                say(f"v{version - 1}->v{version} {wire:>20}: {row['delta_bytes']:>9,} / {row['full_bytes']:>9,} B "
                    f"= {row['ratio']:.3f}" + (f", visible {row['visible']:.3f}" if "visible" in row else "")
                    + (f", encode {row['encode_s'] * 1e3:.1f} ms, apply {row['apply_s'] * 1e3:.1f} ms"
                       if "encode_s" in row else ""))
        held, held_version = now, version
    return rows


def report(rows: list[dict], run: Path, args, real: tuple[list[dict], Path] | None = None):
    from launch.results import Section, figure

    sec = Section("delta_sync", "Delta weight sync: bytes per sync over a real int8 run, delta vs full vs bf16")
    bf16 = {r["version"]: r["full_bytes"] for r in rows if r["wire"] == "bf16"}
    int8 = [r for r in rows if r["wire"] == "int8"]
    sec.table("Per sync of the int8 wire as sent (v-1 -> v)",
              ["version", "full int8 B", "delta B", "delta / full int8", "delta / bf16", "int8 weights changed",
               "learner's visible fraction", "encodings (tensors)", "encode ms", "apply ms", "apply unchecked ms"],
              [[r["version"], r["full_bytes"], r["delta_bytes"], r["ratio"], r["delta_bytes"] / bf16[r["version"]],
                r["visible"], r["learner_visible"], ", ".join(f"{e} {c}" for e, c in r["encodings"].items()),
                r["encode_s"] * 1e3, r["apply_s"] * 1e3, r["apply_unchecked_s"] * 1e3] for r in int8],
              note="bf16 bytes per sync: the weights cast, " + f"{next(iter(bf16.values())):,} B. "
                   "Goal: delta <= 0.2x the full int8 bytes at the demo's learning rate.")
    summary = []
    for wire in dict.fromkeys(r["wire"] for r in rows):
        rs = [r for r in rows if r["wire"] == wire]
        after = [r for r in rs if r["version"] > args.warmup] or rs
        summary.append([wire, rs[0]["full_bytes"], statistics.median(r["delta_bytes"] for r in after),
                        statistics.median(r["ratio"] for r in after), max(r["ratio"] for r in rs),
                        statistics.median(r["visible"] for r in after) if "visible" in rs[0] else None,
                        statistics.median(r["encode_s"] for r in after) * 1e3 if "encode_s" in rs[0] else None,
                        statistics.median(r["apply_s"] for r in after) * 1e3 if "apply_s" in rs[0] else None])
    sec.table(f"By wire, median over the syncs after the LR warm-up (versions > {args.warmup})",
              ["wire", "full B", "delta B", "delta / full", "worst delta / full", "int8/fp8 weights changed",
               "encode ms", "apply ms"], summary,
              note="`int8` is the wire as sent; `int8 (7-bit|8-bit weights)` re-quantizes the same weights in the "
                   "other weight range (`quant.int8.weights`: 7-bit on CPUs without VNNI, else 8-bit); "
                   "`fp8` is learner-side per-channel float8_e4m3fn; `bf16` is the weights cast. Each delta is against "
                   "the same wire's previous version.")
    fig, ((ax,),) = figure(1)
    for wire in dict.fromkeys(r["wire"] for r in rows):
        rs = [r for r in rows if r["wire"] == wire]
        ax.plot([r["version"] for r in rs], [r["ratio"] for r in rs], marker="o", label=wire)
    ax.axhline(0.2, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("version (sync v-1 -> v)")
    ax.set_ylabel("delta bytes / full bytes of the wire")
    ax.legend(fontsize=8)
    sec.plot(fig, "ratio", "Delta bytes over full bytes per sync, by wire; dashed: the 0.2 goal")
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    lr = cfg["learner"]["lr"]
    sec.note(f"The run: `rlpipe demo --precision int8`, {cfg['steps']} steps of {cfg['learner']['groups_per_step']} "
             f"groups, {cfg['workers']} worker, learning rate {lr:g} ({cfg['learner']['schedule']['kind']}, "
             f"{cfg['learner']['schedule']['warmup_steps']} warm-up steps: the demo's), checkpoint every step. Adam moves every weight by about the learning rate whatever the "
             "batch, so the share of int8 values that change is set by the learning rate against the quantization "
             "step (row amax / 127, or / 63 for 7-bit weights), not by the batch size. The toy's weights are small "
             "for its learning rate, so about a fifth of its int8 values move each step; the real model's recipe "
             "below, at its learning rate of 2e-5, moves about one in a thousand.")
    sec.note("Encodings per tensor (weight_sync/delta_codec.py): dense, sparse (gaps + values), bitmap (bit mask + values), and "
             "the same positions with one sign bit per changed value where it moved by one step (the few that moved "
             "further overwritten from a sparse list). Smallest by exact byte count. On the toy bf16 gains little "
             "(most of its values move every update); on the real model at its learning rate a bf16 delta is a few "
             "percent of the bytes too (below), but rlpipe sends deltas for quantized wires only (docs/weight-sync.md). "
             "Times: 1 thread, toy-sized tensors, "
             "checksums (CRC-32 of each held and produced tensor) included in encode and in apply; 'unchecked' "
             "skips them. At this size (0.5 MB, 40 tensors per sync) the times are mostly per-tensor overhead, and "
             "this machine is shared: read them as an order of magnitude.")
    if real:
        real_table(sec, *real)
    if args.quick:
        sec.note("--quick: a few steps of the toy, CI-sized; the numbers mean little.")
    sec.data = {"run": str(run), "rows": rows, **({"real_run": str(real[1]), "real_rows": real[0]} if real else {})}
    return sec


def real_table(sec, rows: list[dict], run: Path) -> None:
    """The real model's syncs by wire, over the versions its learning rate moved (the first
    step's warm-up LR is 0), with the link speed below which a delta is the faster sync."""
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    moved = [r for r in rows if r["delta_bytes"] > 0] or rows
    by_wire = []
    for wire in dict.fromkeys(r["wire"] for r in moved):
        rs = [r for r in moved if r["wire"] == wire]
        timed = "encode_s" in rs[0]
        work_s = statistics.median(r["encode_s"] + r["apply_s"] for r in rs) if timed else None
        saved = rs[0]["full_bytes"] - statistics.median(r["delta_bytes"] for r in rs)
        by_wire.append([wire, rs[0]["full_bytes"], statistics.median(r["delta_bytes"] for r in rs),
                        statistics.median(r["ratio"] for r in rs), max(r["ratio"] for r in rs),
                        statistics.median(r["visible"] for r in rs) if "visible" in rs[0] else None,
                        statistics.median(r["encode_s"] for r in rs) * 1e3 if timed else None,
                        statistics.median(r["apply_s"] for r in rs) * 1e3 if timed else None,
                        saved / work_s / 1e6 if timed else None])
    sec.table(f"The real model's recipe: {cfg['model']['path'].rstrip('/').split('/')[-1]}, int8 rollout, learning "
              f"rate {cfg['learner']['lr']:g}, median over the {len(moved) // len(by_wire)} syncs the LR moved",
              ["wire", "full B", "delta B", "delta / full", "worst delta / full", "int8/fp8 weights changed",
               "encode ms", "apply ms", "delta faster below (MB/s a worker)"], by_wire,
              note=f"`rlpipe demo --config configs/smollm2-math.yaml --precision int8`, {cfg['steps']} steps of "
                   f"{cfg['learner']['groups_per_step']} groups, checkpoint every step ({run.name}); the same "
                   "measurement as above on the recipe's own learning rate (the first sync, at the warm-up's LR of "
                   "0, changed nothing and is left out). A delta costs the learner its encode once for the whole "
                   "fleet and each worker its apply; it saves (full - delta) bytes per worker on the learner's "
                   "link. The last column is where the two meet: the learner's link speed divided by the workers "
                   "it feeds, below which a delta sync is the faster one (on CPU, one thread, checksums included).")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--groups", type=int, default=16, help="learner.groups_per_step")
    ap.add_argument("--warmup", type=int, default=5, help="the demo's LR warm-up steps (for the summary)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help=f"CI smoke: {QUICK}, 1 repeat")
    ap.add_argument("--out", help="where the run is kept (runs/delta_sync, or runs/delta_sync-quick)")
    ap.add_argument("--from-run", help="measure this kept run instead of training one")
    ap.add_argument("--reuse", help="measure this run if it is an int8 run with a checkpoint at step 1, else train")
    ap.add_argument("--real-steps", type=int, default=0,
                    help="also train the real model's recipe (configs/smollm2-math.yaml) this many steps in int8 "
                         "and measure its syncs (0: not)")
    ap.add_argument("--real-from-run", help="measure this kept run of the real model's recipe instead")
    ap.add_argument("--json", help="write the report section here (launch/results.py)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.groups, args.repeats = QUICK["steps"], QUICK["groups"], 1
    if args.from_run:
        run = Path(args.from_run)
    elif args.reuse and reusable(Path(args.reuse)):
        run = Path(args.reuse)
        say(f"measuring the kept run {run}")
    else:
        out = Path(args.out) if args.out else ROOT / "runs" / ("delta_sync-quick" if args.quick else "delta_sync")
        run = train(args.steps, args.groups, out.resolve())
    t0 = time.time()
    rows = measure(run, args.repeats)
    say(f"measured {len(rows)} syncs in {time.time() - t0:.0f}s")
    real = None
    if args.real_from_run or args.real_steps:
        out = Path(args.out) if args.out else ROOT / "runs" / "delta_sync"
        recipe = str(ROOT / "configs" / "smollm2-math.yaml")
        real_run = Path(args.real_from_run) if args.real_from_run else \
            train(args.real_steps, None, out.resolve(), recipe, "delta-int8-smollm2")
        real = (measure(real_run, args.repeats), real_run)
    if args.json:
        report(rows, run, args, real).write(args.json)
    return rows


if __name__ == "__main__":
    main()
