"""Seed 002's comparison on the toy task, in one command: does int8 rollout need TIS?

Three arms, each a whole ``rlpipe demo`` run (Redis, workers and learner as separate
processes) per seed, identical but for the rollout precision and the correction:

    bf16          bf16 rollout, no correction          (the baseline)
    int8          int8 W8A8 rollout, no correction     (calibration transfer, static scales)
    int8+tis      int8 W8A8 rollout, token-level TIS   (is_cap C = 2)

``queue.max_lag`` is 0 by default, so the mismatch measured is the precision's, not the
policy lag's. Writes ``<out>/int8_tis.png`` (reward and mismatch KL per arm over steps,
mean over seeds with each seed faint) and ``<out>/int8_tis.md`` (final reward and mean
mismatch KL per arm and seed), and prints the table. Every run stays in ``<out>/runs/``.

    python bench/int8_tis.py --seeds 0,1 --steps 60
    python bench/int8_tis.py --seeds 0 --steps 5 --set learner.groups_per_step=8   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = {"bf16": {"rollout.precision": "bf16", "learner.is_mode": "none"},
        "int8": {"rollout.precision": "int8", "learner.is_mode": "none"},
        "int8+tis": {"rollout.precision": "int8", "learner.is_mode": "token_tis"}}


def final(rows: list[dict], key: str, k: int = 5) -> float:
    tail = [r[key] for r in rows[-k:] if r.get(key) is not None]
    return sum(tail) / len(tail) if tail else float("nan")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default="runs/int8_tis")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config key for every arm, e.g. --set quant.activations=dynamic")
    ap.add_argument("--from-runs", action="store_true", help="redo the table and plot from the runs in --out")
    args = ap.parse_args(argv)
    from learner.metrics import read_jsonl
    from rlpipe.config import build_config
    from rlpipe.demo import run_demo

    out = Path(args.out).resolve()
    common = {"queue.max_lag": 0, "steps": args.steps}
    for item in args.set:
        key, _, value = item.partition("=")
        common[key] = yaml.safe_load(value)
    arms = args.arms.split(",")
    rows = []
    curves: dict[str, list[list[dict]]] = {a: [] for a in arms}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in arms:
            run_id = f"{arm.replace('+', '-')}-s{seed}"
            print(f"[int8_tis] {run_id}: {args.steps} steps", file=sys.stderr, flush=True)
            if args.from_runs:
                summary = json.loads((out / "runs" / run_id / "summary.json").read_text())
            else:
                cfg = build_config({}, environ={}, seed=seed, run_id=run_id, **common, **ARMS[arm])
                summary = run_demo(cfg, runs_dir=str(out / "runs"), progress=False, timeout_s=7200)
            metrics = read_jsonl(out / "runs" / run_id / "metrics.jsonl")
            curves[arm].append(metrics)
            rows.append({"arm": arm, "seed": seed, "steps": len(metrics), "reward_start": summary["reward_start"],
                         "reward_end": final(metrics, "reward_mean"),
                         "mismatch_kl_mean": statistics.fmean(r["mismatch_kl"] for r in metrics),
                         "mismatch_k3_kl_mean": statistics.fmean(r["mismatch_k3_kl"] for r in metrics),
                         "mismatch_kl_fresh_mean": statistics.fmean(
                             [r["mismatch_kl_fresh"] for r in metrics if r.get("mismatch_kl_fresh") is not None] or [0]),
                         "is_truncated_fraction_mean": statistics.fmean(r["is_truncated_fraction"] for r in metrics),
                         "quant_kl_vs_bf16_mean": statistics.fmean(
                             [r["quant_kl_vs_bf16"] for r in metrics if "quant_kl_vs_bf16" in r] or [float("nan")]),
                         "rl_seconds": summary["rl_seconds"], "completed": summary["completed"]})
    table = format_table(rows, common)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int8_tis.md").write_text(table + "\n")
    (out / "int8_tis.json").write_text(json.dumps(rows, indent=1))
    plot(curves, out / "int8_tis.png")
    print(f"\nwrote {out / 'int8_tis.md'} and {out / 'int8_tis.png'}")
    return rows


def format_table(rows: list[dict], common: dict) -> str:
    lines = [f"Settings: {', '.join(f'{k}={v}' for k, v in common.items())}; reward_end = mean of the last 5 steps.",
             "", "| arm | seed | reward start | reward end | mismatch KL (k1, mean) | k3 KL | KL, staleness 0 | "
             "IS truncated | int8 vs bf16 KL (probe) | RL seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['seed']} | {r['reward_start']:.3f} | {r['reward_end']:.3f} | "
                     f"{r['mismatch_kl_mean']:.2e} | {r['mismatch_k3_kl_mean']:.2e} | {r['mismatch_kl_fresh_mean']:.2e} | "
                     f"{r['is_truncated_fraction_mean']:.4f} | {r['quant_kl_vs_bf16_mean']:.2e} | {r['rl_seconds']:.0f} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, (arm, runs) in enumerate(curves.items()):
        color = f"C{i}"
        for run in runs:
            ax_r.plot([r["step"] for r in run], [r["reward_mean"] for r in run], color=color, alpha=0.25)
            ax_k.plot([r["step"] for r in run], [r["mismatch_k3_kl"] for r in run], color=color, alpha=0.25)
        n = min(len(run) for run in runs) if runs else 0
        steps = list(range(1, n + 1))
        ax_r.plot(steps, [statistics.fmean(run[j]["reward_mean"] for run in runs) for j in range(n)], color=color,
                  linewidth=2, label=f"{arm} (mean of {len(runs)} seeds)")
        ax_k.plot(steps, [statistics.fmean(run[j]["mismatch_k3_kl"] for run in runs) for j in range(n)], color=color,
                  linewidth=2, label=arm)
    ax_r.set(xlabel="learner step", ylabel="mean reward (sampled)", title="reward")
    ax_k.set(xlabel="learner step", ylabel="mismatch KL per token (k3, never negative)",
             title="rollout-training mismatch", yscale="log")
    for ax in (ax_r, ax_k):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("seed 002 on the toy task: int8 rollout with and without token TIS")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
