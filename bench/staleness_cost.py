"""What the staleness bound costs under dynamic sampling: the toy demo at queue.max_lag 0 and 1, side by side.

``queue.max_lag`` bounds the staleness of every trained group: the fleet's allowance grows by the
sampled-per-trained ratio (more groups per version, not further ahead), and a group that still
arrives too late is dropped, never trained. At 2 answers a prompt about half the toy's groups have
no reward spread and are filtered, so the fleet samples about twice what the learner trains. Each arm
is a whole ``rlpipe demo`` in one run of this script; each reports the largest staleness trained,
the groups trained, filtered and dropped, and the workers' idle fraction. ``--loose`` adds the arms
with ``queue.max_staleness: 4``, the bound before it was hard, for the comparison.

    python -P bench/staleness_cost.py --loose         # max_lag 0 and 1, hard and loosened, 12 steps each
    python -P bench/staleness_cost.py --steps 2 --lags 0   # a smoke run

``--earlier ROWS.json --earlier-label TEXT`` adds, beside this run's arms, the arms of an earlier
run of this script (its ``--json`` section, made at another commit on the same machine), each
marked with the label: a change to the hand-out measured side by side, one code after the other.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def arm(max_lag: int, max_staleness: int | None, steps: int, runs_dir: str) -> dict:
    """One demo at this bound, and its books."""
    from launch.demo import run_demo
    from learner.metrics import read_jsonl
    from rlpipe.config import build_config

    run_id = f"lag{max_lag}-{'loose' if max_staleness is not None else 'hard'}"
    cfg = build_config({}, environ={}, steps=steps, seed=0, run_id=run_id, **{
        "queue.max_lag": max_lag, "queue.max_staleness": max_staleness, "sampling.n": 2,
        "learner.groups_per_step": 8})
    t0 = time.monotonic()
    summary = run_demo(cfg, runs_dir=runs_dir, progress=False)
    rows = read_jsonl(Path(runs_dir) / run_id / "metrics.jsonl")
    produced = summary["groups_produced"]
    idle = idle_fraction(rows)
    return {"max_lag": max_lag, "max_staleness": max_staleness, "steps": len(rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "staleness_mean": round(sum(r["staleness_mean"] * r["groups"] for r in rows)
                                    / max(1, sum(r["groups"] for r in rows)), 3),
            "produced": produced, "trained": summary["groups_trained"], "filtered": summary["groups_filtered"],
            "dropped_stale": summary["groups_dropped_stale"],
            "dropped_fraction": round(summary["groups_dropped_stale"] / max(1, produced), 3),
            "rollout_idle_fraction": None if idle is None else round(idle, 3),
            "seconds": round(time.monotonic() - t0, 1)}


def idle_fraction(rows: list[dict]) -> float | None:
    """The workers' idle fraction over the whole run: the change of their idle seconds (a running
    total in every metrics row) over workers x the seconds between the first and the last row. The
    autoscaler's own ``fleet_idle_fraction`` is a sliding window that a short run never fills."""
    timed = [r for r in rows if r.get("rollout_idle_seconds_total") is not None and r.get("rollout_workers")]
    if len(timed) < 2 or timed[-1]["time"] <= timed[0]["time"]:
        return None
    first, last = timed[0], timed[-1]
    span = (last["time"] - first["time"]) * last["rollout_workers"]
    return (last["rollout_idle_seconds_total"] - first["rollout_idle_seconds_total"]) / span


def section(rows: list[dict], machine: str, command: str, earlier: list[dict] | None = None, label: str = ""):
    """The results section: each bound's books side by side (with ``earlier``'s arms, labelled, after them)."""
    from launch.results import Section

    sec = Section("staleness", "The staleness bound under dynamic sampling: what it costs (toy, max_lag 0 and 1)",
                  command)
    arms = [("this code", r) for r in rows] + [(label or "an earlier run", r) for r in earlier or []]
    sec.table("Each arm a whole demo: 2 answers a prompt, 8 groups a step", [
        "code", "queue.max_lag", "queue.max_staleness", "steps", "largest staleness trained", "mean staleness",
        "produced", "trained", "filtered", "dropped stale", "dropped / produced", "workers idle", "seconds"],
        [[code, r["max_lag"], "null (= max_lag)" if r["max_staleness"] is None else r["max_staleness"], r["steps"],
          r["staleness_max"], r["staleness_mean"], r["produced"], r["trained"], r["filtered"], r["dropped_stale"],
          r["dropped_fraction"], r["rollout_idle_fraction"], r.get("seconds")] for code, r in arms])
    sec.note(f"On {machine}. The bound holds by construction (the learner drops an older group and counts it); "
             "the cost is the groups sampled for a version that arrive after the learner moved on (dropped stale), "
             "and the workers' time with no group in flight (workers idle, over the whole run: the change of "
             "rollout_idle_seconds_total over workers x its span). Sampling more per version instead of further "
             "ahead drops fewer groups and leaves the workers idler where, as here, the learner is the bound.")
    sec.data = {"machine": machine, "rows": rows, "earlier": earlier or [], "earlier_label": label}
    return sec


def main(argv: list[str] | None = None) -> list[dict]:
    from rlpipe.machine import cpu_name

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="learner steps of each arm")
    p.add_argument("--lags", default="0,1", help="the queue.max_lag values, comma-separated")
    p.add_argument("--loose", action="store_true", help="also each lag at queue.max_staleness 4")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--earlier", type=Path, help="an earlier run's --json section, whose arms are shown beside these")
    p.add_argument("--earlier-label", default="", help="what the earlier arms ran (e.g. the commit)")
    args = p.parse_args(argv)
    print(cpu_name(), file=sys.stderr)  # the model, the cores and the SIMD flags that choose the kernels
    lags = [int(x) for x in args.lags.split(",")]
    bounds = [(lag, None) for lag in lags] + ([(lag, 4) for lag in lags] if args.loose else [])
    with tempfile.TemporaryDirectory() as runs_dir:
        rows = [arm(lag, loose, args.steps, runs_dir) for lag, loose in bounds]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        command = f"python -P bench/staleness_cost.py --steps {args.steps} --lags {args.lags}" + \
            (" --loose" if args.loose else "")
        earlier = json.loads(args.earlier.read_text())["data"]["rows"] if args.earlier else None
        if earlier:
            command += f" --earlier {args.earlier.name} --earlier-label '{args.earlier_label}'"
        section(rows, cpu_name(), command, earlier, args.earlier_label).write(args.json)
    return rows


if __name__ == "__main__":
    main()
