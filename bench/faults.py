"""Faults in one run, as a deployment has them, and how the pipeline came back: the
chaos test's run (launch/chaos.py, which tests/test_chaos.py checks: SIGKILLs of the
learner twice, of a worker and of redis-server, which also loses its last second of AOF)
as a command, with a report and a plot of staleness, drops and reward over the learner's
steps, faults marked.

    python bench/faults.py [--seed 12] [--steps 30] [--out docs/faults]

Prints and writes ``report.json`` (faults; groups lost and trained twice; counters;
staleness and drop rate before the first fault and after the last; seconds from each
learner restart to its first trained step) and ``faults.png``. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.chaos import run_chaos  # noqa: E402
from launch.toy import TOY_SPEC, ensure_toy_model  # noqa: E402


def run(seed: int, steps: int, work: Path) -> tuple[dict, list[dict], list[tuple[int, str]]]:
    chaos = run_chaos(work, str(ensure_toy_model(TOY_SPEC, log=print)), seed, steps, password="bench-pw", log=print)
    cluster, books, parts = chaos.cluster, chaos.books, chaos.parts
    report = {
        "seed": seed, "faults": cluster.faults, "groups_lost": books["lost"], "groups_trained_twice": books["trained_twice"],
        "counters": books["counters"], "before_first_fault": chaos.before, "after_last_fault": chaos.after,
        "restart_to_first_step_s": [round(p[0]["learner_start_to_first_step_seconds"], 1) for p in parts[1:]],
    }
    return report, chaos.rows, list(zip(cluster.fault_rows, cluster.faults))


def plot(rows: list[dict], marks: list[tuple[int, str]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(1, len(rows) + 1)  # steps in the order they were trained (a restart retrains some)
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    panels = [("staleness_mean", "mean staleness (versions)"), ("dropped_stale_step", "groups dropped as stale"),
              ("reward_mean", "mean reward")]
    for ax, (key, label) in zip(axes, panels):
        ax.plot(x, [r[key] for r in rows], marker=".")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        for row, what in marks:
            ax.axvline(row + 0.5, color="red", alpha=0.5, linestyle="--")
    for row, what in marks:
        axes[0].annotate(what.split(" at ")[0].replace("SIGKILL ", "kill "), (row + 0.5, axes[0].get_ylim()[1]),
                         rotation=90, va="top", ha="right", fontsize=8, color="red")
    axes[-1].set_xlabel("learner steps, in the order trained (steps since a restart's checkpoint are trained again)")
    fig.suptitle("Faults and recovery: staleness, drops and reward per learner step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="docs/faults")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlpipe-faults-") as work:
        report, rows, marks = run(args.seed, args.steps, Path(work))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot(rows, marks, out / "faults.png")
    print(json.dumps(report, indent=1))
    print(f"wrote {out / 'report.json'} and {out / 'faults.png'}")


if __name__ == "__main__":
    main()
