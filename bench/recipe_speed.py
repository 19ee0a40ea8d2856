"""The README's recipe in the precisions it pinned before against the machine's own, side by side.

``configs/smollm2-math.yaml`` ran fp32 rollout and an fp32 learner on every machine. With
``precision: auto`` (rollout) and ``learner.dtype: auto`` it runs what this CPU computes fastest
(rlpipe/machine.py). This runs the recipe twice on one machine, one arm after the other, the same
seed and steps, with evaluation off so that only training's pace counts:

- **pinned**: ``--precision fp32 --set learner.dtype=fp32``, the recipe as it was;
- **auto**: the recipe as it is.

and reports each arm's RL steps per hour over the steps after the first two (3600 x steps / the
wall time between their metrics rows), its seconds per step split into the learner's training,
weight sync and wait for groups, and the ratio auto / pinned. The CPU is named beside the numbers.

    python -P bench/recipe_speed.py --runs-dir runs                                  # 2 x 12 steps
    python -P bench/recipe_speed.py --runs-dir runs --json docs/results/recipe-speed.json   # and the section

A finished arm (its ``summary.json`` in ``<runs-dir>/speed-<arm>``) is not run again.
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

ARMS = {  # name -> (label, extra demo flags)
    "pinned": ("fp32 rollout, fp32 learner (pinned before)", ["--precision", "fp32", "--set", "learner.dtype=fp32"]),
    "auto": ("precision auto, learner.dtype auto", []),
}
WARMUP = 2  # steps left out: the first compiles the engine's graphs and fills the queue


def demo_command(name: str, runs_dir: Path, steps: int, seed: int) -> list[str]:
    return [sys.executable, "-m", "launch.cli", "demo", "--config", "configs/smollm2-math.yaml", "--seed", str(seed),
            "--steps", str(steps), "--set", "eval.every=0", "--set", "eval.base_at_rest=false",
            "--set", "eval.exported=false", "--run-id", f"speed-{name}", "--runs-dir", str(runs_dir),
            *ARMS[name][1]]


def run_arm(name: str, runs_dir: Path, steps: int, seed: int) -> None:
    from bench.tool_arms import run_demo_arm

    run_demo_arm(name, f"speed-{name}", runs_dir, demo_command(name, runs_dir, steps, seed))


def arm_row(name: str, runs_dir: Path) -> dict | None:
    """One arm's pace from its metrics rows (the step rows, not the evaluations')."""
    path = runs_dir / f"speed-{name}" / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("kind", "step") == "step" and "learner_step_seconds" in r]
    steady = [r for r in steps if r["step"] > WARMUP]
    if len(steady) < 2:
        return None
    wall = steady[-1]["time"] - steady[0]["time"]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in steady[1:])  # noqa: E731
    config = yaml.safe_load((runs_dir / f"speed-{name}" / "config.yaml").read_text())  # auto as resolved
    return {"arm": name, "label": ARMS[name][0], "rollout": config["rollout"]["precision"],
            "learner": config["learner"]["dtype"],
            "steps": len(steady) - 1, "seconds_per_step": wall / (len(steady) - 1),
            "steps_per_hour": 3600 * (len(steady) - 1) / wall, "train_s": mean("learner_train_seconds"),
            "sync_s": mean("weight_sync_seconds"), "wait_s": mean("learner_wait_seconds"),
            "tokens_per_second": mean("learner_tokens_per_second"), "reward": mean("reward_mean")}


def section(report: dict):
    """The report section (launch/results.py), from the JSON this writes."""
    from launch.results import Section

    rows = report["rows"]
    sec = Section("recipe-speed", "The README's recipe: RL steps per hour, pinned fp32 against precision auto")
    base = rows.get("pinned", {}).get("steps_per_hour")
    sec.table(f"configs/smollm2-math.yaml, {report['steps']} steps each, evaluation off, seed {report['seed']}; "
              f"steps after the first {WARMUP}; {report['cpu']}",
              ["arm", "rollout", "learner", "steps/h", "vs pinned", "s/step", "learner train s", "sync s",
               "learner wait s", "learner tokens/s"],
              [[r["label"], r["rollout"], r["learner"], r["steps_per_hour"],
                r["steps_per_hour"] / base if base else None, r["seconds_per_step"], r["train_s"], r["sync_s"],
                r["wait_s"], r["tokens_per_second"]] for r in rows.values()],
              note="Each arm is a whole `rlpipe demo` (Redis, 2 rollout workers, the learner), one after the other on "
                   "the same machine. learner wait = seconds the learner waited for groups with a reward spread.")
    for r in rows.values():
        share = r["train_s"] / r["seconds_per_step"]
        sec.note(f"{r['label']}: the learner trained {share:.0%} of each step's wall time and waited for groups "
                 f"{r['wait_s'] / r['seconds_per_step']:.0%}; the larger of the two is the role that bounds the step.")
    sec.data = report
    return sec


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated arms (pinned, auto)")
    ap.add_argument("--json", type=Path, help="write the report section's data here")
    args = ap.parse_args(argv)
    from rlpipe.machine import cpu_name

    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(ARMS)
    for name in names:
        run_arm(name, args.runs_dir, args.steps, args.seed)
    rows = {n: row for n in ARMS if (row := arm_row(n, args.runs_dir))}
    report = {"steps": args.steps, "seed": args.seed, "cpu": cpu_name(), "rows": rows}
    for r in rows.values():
        print(f"{r['label']}: {r['steps_per_hour']:.1f} steps/h ({r['seconds_per_step']:.1f} s/step: train "
              f"{r['train_s']:.1f}, sync {r['sync_s']:.1f}, wait {r['wait_s']:.1f})")
    if "pinned" in rows and "auto" in rows:
        print(f"auto / pinned: {rows['auto']['steps_per_hour'] / rows['pinned']['steps_per_hour']:.2f}x")
    print(json.dumps(report, indent=1))
    if args.json and rows:
        section(report).write(args.json)
    return report


if __name__ == "__main__":
    main()
