"""Issue 12, item 6: which ``learner.schedule.warmup_steps`` removes the demo's step-2 KL spike
without slowing the reward curve?

Without warmup, Adam's first step moves every weight by about ``lr`` (its normalized update
m / sqrt(v) is +-1 when the moments hold one gradient), so the policy the workers sample
from at step 2 (version 0, one version behind under ``queue.max_lag: 1``) is far from the
learner's version 1, and the mismatch KL jumps. This runs the plain demo (its defaults, only
``warmup_steps`` set explicitly, so a changed default cannot leak in) once per setting and
seed, then prints and writes a table per setting:

    early KL       mismatch KL (k1, as the demo prints it) at steps 1..5 and their max
    spike ratio    max early KL / median KL of steps 21..end (the run's own steady level)
    spike gone     max early KL <= the 90th percentile of the per-step KL of steps 21..end
                   in the no-warmup runs (mean over their seeds): no higher than a normal step
    reward         mean reward over steps 1-20, 21-40 and the last 20
    to threshold   first step whose trailing --window mean reward reaches --threshold

Writes ``<out>/warmup.png`` (reward and k1 mismatch KL, log y, per setting, mean over
seeds), ``<out>/warmup.md`` (the table), ``<out>/runs.json`` (one row per run) and
``<out>/curves.csv`` (a few metrics per step and run, enough to redo table and plot). The
runs themselves stay in ``--runs-dir``.

    python bench/warmup.py                                   # 0,3,5,10 x seeds 0,1, 100 steps
    python bench/warmup.py --from-runs                       # redo table and plot
    python bench/warmup.py --warmups 0,3 --seeds 0 --steps 5 --set learner.groups_per_step=8   # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIELDS = ["warmup", "seed", "step", "reward_mean", "mismatch_kl", "mismatch_k3_kl", "learner_lr", "staleness_mean",
          "time"]


def run_id(warmup: int, seed: int) -> str:
    return f"w{warmup}-s{seed}"


def mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def steps_to(rewards: list[float], threshold: float, window: int) -> int | None:
    """The first step (1-based) whose trailing ``window``-step mean reward reaches ``threshold``."""
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1: i + 1]) >= threshold:
            return i + 1
    return None


def run_row(warmup: int, seed: int, metrics: list[dict], info: dict, threshold: float, window: int) -> dict:
    kl = [r["mismatch_kl"] for r in metrics]
    rewards = [r["reward_mean"] for r in metrics]
    steady = statistics.median(kl[20:]) if len(kl) > 20 else float("nan")
    p90 = statistics.quantiles(kl[20:], n=10)[-1] if len(kl) > 21 else float("nan")
    return {"warmup": warmup, "seed": seed, "steps": len(metrics),
            "kl_early": kl[:5], "kl_early_max": max(kl[:5]),
            "k3_early_max": max(r["mismatch_k3_kl"] for r in metrics[:5]),
            "kl_steady_median": steady, "kl_steady_p90": p90, "spike_ratio": max(kl[:5]) / steady if steady > 0 else float("nan"),
            "reward_1_20": mean(rewards[:20]), "reward_21_40": mean(rewards[20:40]), "reward_last20": mean(rewards[-20:]),
            "steps_to_threshold": steps_to(rewards, threshold, window),
            "wall_seconds": info.get("wall_seconds"), "rl_seconds": info.get("rl_seconds"),
            "completed": info.get("completed")}


def load_curves(out: Path) -> dict[tuple[int, int], list[dict]]:
    curves: dict[tuple[int, int], list[dict]] = {}
    with open(out / "curves.csv") as f:
        for r in csv.DictReader(f):
            key = (int(r["warmup"]), int(r["seed"]))
            curves.setdefault(key, []).append({k: float(v) if v != "" else None for k, v in r.items()})
    for rows in curves.values():
        for r in rows:
            r["step"] = int(r["step"])
    return curves


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmups", default="0,3,5,10", help="warmup_steps values, one run per value and seed")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "docs" / "lr_warmup"), help="table, plot and the small summaries")
    ap.add_argument("--runs-dir", default="/tmp/warmup_runs", help="the run directories (large: not for git)")
    ap.add_argument("--threshold", type=float, default=0.45, help="reward for the steps-to-threshold column")
    ap.add_argument("--window", type=int, default=10, help="trailing mean for the steps-to-threshold column")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config key for every run, e.g. --set queue.max_lag=0")
    ap.add_argument("--from-runs", action="store_true",
                    help="no new runs: redo table and plot from --runs-dir, or from <out>/curves.csv where a run is gone")
    ap.add_argument("--rerun", action="store_true", help="run again even where a completed run exists")
    args = ap.parse_args(argv)
    from launch.demo import run_demo
    from learner.metrics import read_jsonl
    from rlpipe.config import build_config

    out, runs_dir = Path(args.out).resolve(), Path(args.runs_dir).resolve()
    common: dict = {"steps": args.steps}
    for item in args.set:
        key, _, value = item.partition("=")
        common[key] = yaml.safe_load(value)
    warmups, seeds = [int(w) for w in args.warmups.split(",")], [int(s) for s in args.seeds.split(",")]
    saved = load_curves(out) if args.from_runs and (out / "curves.csv").exists() else {}
    saved_info = {(r["warmup"], r["seed"]): r for r in json.loads((out / "runs.json").read_text())} \
        if args.from_runs and (out / "runs.json").exists() else {}

    rows, curves = [], {}
    for seed in seeds:
        for w in warmups:
            rid = run_id(w, seed)
            run_dir = runs_dir / rid
            summary_path = run_dir / "summary.json"
            done = summary_path.exists() and json.loads(summary_path.read_text()).get("completed")
            if not args.from_runs and (args.rerun or not done):
                print(f"[warmup] {rid}: {args.steps} steps", file=sys.stderr, flush=True)
                cfg = build_config({}, environ={}, seed=seed, run_id=rid, **common,
                                   **{"learner.schedule.warmup_steps": w})
                run_demo(cfg, runs_dir=str(runs_dir), progress=False, timeout_s=7200)
            if summary_path.exists():
                info, metrics = json.loads(summary_path.read_text()), read_jsonl(run_dir / "metrics.jsonl")
                metrics = [dict(r, warmup=w, seed=seed) for r in metrics]
            elif (w, seed) in saved:
                info, metrics = saved_info.get((w, seed), {}), saved[(w, seed)]
            else:
                print(f"[warmup] {rid}: no run in {runs_dir} and none in {out / 'curves.csv'}; left out",
                      file=sys.stderr)
                continue
            curves[(w, seed)] = metrics
            rows.append(run_row(w, seed, metrics, info, args.threshold, args.window))

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        writer.writeheader()
        for metrics in curves.values():
            writer.writerows({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k)) for k in FIELDS}
                             for r in metrics)
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    table = format_table(rows, warmups, common, args.threshold, args.window)
    print(table)
    (out / "warmup.md").write_text(table + "\n")
    plot(curves, warmups, out / "warmup.png", args.threshold, baseline_p90(rows, warmups))
    print(f"\nwrote {out / 'warmup.md'}, {out / 'warmup.png'}, {out / 'runs.json'}, {out / 'curves.csv'}")
    return rows


def baseline_p90(rows: list[dict], warmups: list[int]) -> float:
    """The 90th percentile of a normal step's KL (steps 21..end) without warmup (or the smallest warmup run)."""
    base = 0 if 0 in warmups else min(warmups)
    return mean(r["kl_steady_p90"] for r in rows if r["warmup"] == base)


def format_table(rows: list[dict], warmups: list[int], common: dict, threshold: float, window: int) -> str:
    def fmt_steps(values):
        return "/".join("-" if v is None else str(v) for v in values)

    p90 = baseline_p90(rows, warmups)
    lines = [f"Demo defaults plus {', '.join(f'{k}={v}' for k, v in common.items())}; mismatch KL is k1 "
             f"(what the demo prints); spike ratio = max KL of steps 1-5 / median KL of steps 21-end; "
             f"spike gone = max KL of steps 1-5 <= {p90:.2e}, the 90th percentile of a step's KL over steps "
             f"21-end without warmup; steps to {threshold} = first step whose trailing {window}-step mean reward "
             "reaches it.",
             "", "Per setting, mean over seeds (steps to threshold: each seed):", "",
             "| warmup_steps | seeds | KL step 1 | KL step 2 | KL step 3 | KL step 4 | KL step 5 | max KL 1-5 | "
             "steady KL (median 21-end) | spike ratio | spike gone | reward 1-20 | reward 21-40 | reward last 20 | "
             f"steps to {threshold} |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in warmups:
        rs = [r for r in rows if r["warmup"] == w]
        if not rs:
            continue
        early = [mean(r["kl_early"][i] for r in rs) for i in range(5)]
        early_max = mean(r["kl_early_max"] for r in rs)
        lines.append(f"| {w} | {len(rs)} | " + " | ".join(f"{v:.2e}" for v in early) +
                     f" | {early_max:.2e} | {mean(r['kl_steady_median'] for r in rs):.2e} | "
                     f"{mean(r['spike_ratio'] for r in rs):.1f} | {'yes' if early_max <= p90 else 'no'} | "
                     f"{mean(r['reward_1_20'] for r in rs):.3f} | "
                     f"{mean(r['reward_21_40'] for r in rs):.3f} | {mean(r['reward_last20'] for r in rs):.3f} | "
                     f"{fmt_steps(r['steps_to_threshold'] for r in rs)} |")
    lines += ["", "Per run:", "", "| warmup_steps | seed | max KL 1-5 (k1) | max k3 KL 1-5 | steady KL | spike ratio | "
              f"reward 1-20 | reward 21-40 | reward last 20 | steps to {threshold} | wall s | RL s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["warmup"], r["seed"])):
        wall = "-" if r["wall_seconds"] is None else f"{r['wall_seconds']:.0f}"
        rl = "-" if r["rl_seconds"] is None else f"{r['rl_seconds']:.0f}"
        lines.append(f"| {r['warmup']} | {r['seed']} | {r['kl_early_max']:.2e} | {r['k3_early_max']:.2e} | "
                     f"{r['kl_steady_median']:.2e} | {r['spike_ratio']:.1f} | {r['reward_1_20']:.3f} | "
                     f"{r['reward_21_40']:.3f} | {r['reward_last20']:.3f} | {fmt_steps([r['steps_to_threshold']])} | "
                     f"{wall} | {rl} |")
    return "\n".join(lines)


def plot(curves: dict[tuple[int, int], list[dict]], warmups: list[int], path: Path, threshold: float,
         kl_p90: float) -> None:
    """Reward (mean over seeds, faint, and its 5-step moving mean) and k1 mismatch KL, the
    table's (log y: a step whose mean is not positive, possible only at staleness 0, is left
    out), per warmup setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, w in enumerate(warmups):
        runs = [m for (cw, _), m in sorted(curves.items()) if cw == w]
        if not runs:
            continue
        n = min(len(m) for m in runs)
        steps = list(range(1, n + 1))
        reward = [mean(m[j]["reward_mean"] for m in runs) for j in range(n)]
        smooth = [statistics.fmean(reward[max(0, j - 4): j + 1]) for j in range(n)]
        kl = [mean(m[j]["mismatch_kl"] for m in runs) for j in range(n)]
        color, label = f"C{i}", f"warmup_steps={w} ({len(runs)} seeds)"
        ax_r.plot(steps, reward, color=color, alpha=0.25)
        ax_r.plot(steps, smooth, color=color, linewidth=2, label=label)
        ax_k.plot(steps, kl, color=color, linewidth=1.5, marker="." if n <= 30 else None, label=label)
    ax_r.axhline(threshold, color="k", linestyle=":", linewidth=1)
    ax_k.axhline(kl_p90, color="k", linestyle=":", linewidth=1, label="90th pct. of a step's k1 KL, steps 21+, no warmup")
    ax_r.set(xlabel="learner step", ylabel="mean reward (sampled)",
             title="reward: mean over seeds (faint) and its 5-step moving mean")
    ax_k.set(xlabel="learner step", ylabel="mismatch KL per token (k1)", yscale="log",
             title="rollout-training mismatch KL(mu || pi_old), mean over seeds")
    for ax in (ax_r, ax_k):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("rlpipe demo: linear LR warmup (learner.schedule.warmup_steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
