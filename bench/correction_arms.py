"""Mismatch corrections and on-policy distillation under INT8 rollout, on the real model.

SmolLM2-135M-Instruct served as INT8 W8A8 with a rank-8 LoRA adapter trained on the frozen INT8 base
(configs/smollm2-math.yaml with ``--precision int8``), on the plain task: the recipe without its
calculator (score centering needs answers whose every token the sampler drew). Four arms, each on the
given seeds:

- **tis**: per-token truncated importance sampling (``learner.is_mode: token_tis``, the default);
- **geo**: sequence-level masking (``geo_mask``: a sequence whose geometric-mean ratio leaves the band
  is left out);
- **sc**: score centering alone (``is_mode: none``, ``learner.score_centering_k: 8``);
- **distill**: tis plus on-policy distillation from the unquantized model
  (``learner.teacher.path``: the model given, ``kl_coef`` 0.1), paired with tis of the same seed.

Each arm trains for ``--budget`` seconds (``train_budget_s``), without evaluations on the way; at the
end its last checkpoint is exported (the adapter merged into the unquantized base) and scored, with the
model given, on every held-out MAWPS SingleEq row (455, greedy) on an fp32 engine, paired on the same rows.
The report gives that, the mismatch (k3 a token, the largest token-probability gap), the IS weights'
effective sample size, and the fleet's pace.

    python -P bench/correction_arms.py --runs-dir runs                      # 4 arms x seeds 0, 1
    python -P bench/correction_arms.py --runs-dir runs --only tis,sc --seeds 0 --budget 420
    python -P bench/correction_arms.py --runs-dir runs --report-only --json docs/results/correction-arms.json

A finished arm (its ``summary.json`` in ``<runs-dir>/corr-<arm>-s<seed>``) is not run again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = {  # name -> (label, extra demo flags); {teacher} is the unquantized model's directory
    "tis": ("token TIS", ["--is-mode", "token_tis"]),
    "geo": ("geo mask (sequence)", ["--is-mode", "geo_mask"]),
    "sc": ("score centering, k 8", ["--is-mode", "none", "--set", "learner.score_centering_k=8"]),
    "distill": ("token TIS + distillation from the unquantized model, 0.1",
                ["--is-mode", "token_tis", "--set", "learner.teacher.path={teacher}", "--set", "learner.teacher.kl_coef=0.1"]),
}
COMMON = ["--config", "configs/smollm2-math.yaml", "--precision", "int8", "--set", "task.tool=''",
          "--set", "learner.tool_imitation=0", "--set", "eval.without_tool=false", "--set", "eval.every=0",
          "--set", "eval.exported=true"]
TOPK_BYTES = 6  # a top-k entry on the wire: an int32 id and an fp16 log-prob


def teacher_dir() -> str:
    """The unquantized model given, as a directory (prepared once from the installed wheel)."""
    from launch.demo import resolve_model
    from rlpipe.config import build_config

    return resolve_model(build_config({"model": {"path": "smollm2-135m-instruct"}}, environ={}), log=lambda _: None)


def demo_command(name: str, seed: int, runs_dir: Path, budget: int, teacher: str) -> list[str]:
    flags = [f.format(teacher=teacher) for f in ARMS[name][1]]
    return [sys.executable, "-m", "launch.cli", "demo", *COMMON, "--seed", str(seed), "--set", f"train_budget_s={budget}",
            "--run-id", f"corr-{name}-s{seed}", "--runs-dir", str(runs_dir), *flags]


def arm_row(name: str, seed: int, runs_dir: Path) -> dict | None:
    """One finished arm's numbers from its summary and its per-step metrics."""
    from learner.metrics import read_jsonl

    run_dir = runs_dir / f"corr-{name}-s{seed}"
    if not (run_dir / "summary.json").exists():
        return None
    s = json.loads((run_dir / "summary.json").read_text())
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "learner_step_seconds" in r]
    col = lambda key: [r[key] for r in rows if isinstance(r.get(key), (int, float))]  # noqa: E731
    mean = lambda key: statistics.mean(col(key)) if col(key) else None  # noqa: E731
    length = mean("response_length_mean")
    k = 8 if name == "sc" else 0
    sampled = (s.get("groups_produced") or 0) * 8 * (length or 0)
    return {"arm": ARMS[name][0], "name": name, "seed": seed, "steps": s.get("steps"),
            "given": s.get("eval_given_pass@1"), "exported": s.get("eval_exported_pass@1"),
            "paired": s.get("eval_exported_paired_strict"), "error": s.get("eval_exported_error"),
            "reward": [s.get("reward_start"), s.get("reward_end")], "k3_mean": mean("mismatch_k3_kl"),
            "prob_gap_max": max(col("mismatch_prob_diff_max"), default=None), "ess_mean": mean("is_ess"),
            "ess_min": min(col("is_ess"), default=None), "distill_k3": [col("distill_k3")[:3], col("distill_k3")[-3:]],
            "step_s": mean("learner_step_seconds"), "response_length": length,
            "topk_bytes_per_group": round(8 * (length or 0) * k * TOPK_BYTES) if k else 0,
            "fleet_tokens_per_s": sampled / s["rl_seconds"] if s.get("rl_seconds") else None,
            "wall_minutes": round(s.get("wall_seconds", 0) / 60, 1), "machine": s.get("machine"),
            "vs_tis": versus_tis(run_dir, runs_dir / f"corr-tis-s{seed}") if name != "tis" else None}


def versus_tis(run_dir: Path, tis_dir: Path) -> str | None:
    """This arm's exported model paired, row by row, against the tis arm's of the same seed: both
    results come from the evaluation cache the runs filled (rollout_service/eval_cache.py), so
    nothing is evaluated again."""
    from launch.evaluate import compare
    from rlpipe.config import load_config

    if not (run_dir / "exported").is_dir() or not (tis_dir / "exported").is_dir():
        return None
    cfg = load_config(run_dir / "config.yaml", environ={})
    report = compare(cfg, [str(run_dir / "exported"), str(tis_dir / "exported")], say=lambda _: None)
    return report["models"][1]["paired"]["strict"]


def section(rows: list[dict], budget: int, remark: str = ""):
    from launch.results import Section

    sec = Section("correction-arms", "Mismatch corrections and distillation under INT8 rollout (SmolLM2, LoRA)",
                  "python -P bench/correction_arms.py --runs-dir runs --seeds 0 --json docs/results/correction-arms.json")
    fmt = lambda v, f=".3f": "–" if v is None else format(v, f)  # noqa: E731
    sec.table(f"The exported model (adapter merged, fp32 engine) against the model given, on the 455 held-out "
              f"SingleEq rows, greedy; {budget} s of training an arm", ["arm", "seed", "steps", "given",
              "exported", "paired against the model given", "paired against token TIS, same seed"],
              [[r["arm"], r["seed"], r["steps"], r["given"], r["exported"], r["paired"] or r["error"],
                r["vs_tis"] or "–"] for r in rows])
    sec.table("Mismatch, IS weights and pace over the run", ["arm", "seed", "k3 a token, mean", "largest token "
              "probability gap", "IS ESS, mean", "min", "learner s/step", "fleet tokens/s", "top-k bytes a group",
              "distill k3, first 3 -> last 3 steps"],
              [[r["arm"], r["seed"], fmt(r["k3_mean"], ".2e"), fmt(r["prob_gap_max"]), fmt(r["ess_mean"]),
                fmt(r["ess_min"]), fmt(r["step_s"], ".1f"), fmt(r["fleet_tokens_per_s"], ".1f"),
                r["topk_bytes_per_group"], _ends(r["distill_k3"])] for r in rows])
    machines = sorted({r["machine"] for r in rows if r["machine"]})
    sec.note(f"On {'; '.join(machines)}. Each arm: `rlpipe demo {' '.join(COMMON)} --seed S "
             f"--set train_budget_s={budget}` plus its flags (bench/correction_arms.py ARMS). Fleet tokens/s: groups "
             "produced x 8 answers x the mean trained response length / the run's RL seconds. Top-k bytes a group: "
             f"8 answers x the mean response length x k x {TOPK_BYTES} bytes (an int32 id and an fp16 log-prob).")
    if remark:
        sec.note(remark)
    sec.data = rows
    return sec


def _ends(pair) -> str:
    first, last = pair
    return "–" if not first else f"{statistics.mean(first):.4f} -> {statistics.mean(last):.4f}"


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs", help="where the arms' run directories go")
    p.add_argument("--only", default="", help=f"comma-separated arms, of {', '.join(ARMS)}")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (each arm runs on each)")
    p.add_argument("--budget", type=int, default=420, help="seconds of training an arm (train_budget_s)")
    p.add_argument("--report-only", action="store_true", help="run nothing: report the finished arms")
    p.add_argument("--json", type=Path, help="write the results section here")
    p.add_argument("--note", default="", help="a remark for the report (what else ran, what the numbers say)")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(ARMS)
    if bad := [n for n in names if n not in ARMS]:
        p.error(f"--only: unknown arm(s) {bad}; choose from {list(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not args.report_only:
        from bench.tool_arms import run_demo_arm

        teacher = teacher_dir() if "distill" in names else ""
        for seed in seeds:
            for name in names:
                run_id = f"corr-{name}-s{seed}"
                run_demo_arm(name, run_id, args.runs_dir, demo_command(name, seed, args.runs_dir, args.budget, teacher))
    rows = [r for seed in seeds for n in ARMS if (r := arm_row(n, seed, args.runs_dir))]
    print(json.dumps(rows, indent=1))
    if args.json and rows:
        section(rows, args.budget, args.note).write(args.json)
    return rows


if __name__ == "__main__":
    main()
