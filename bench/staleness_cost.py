"""What the staleness bound costs under dynamic sampling: the toy demo at queue.max_lag 0 and 1, side by side.

``queue.max_lag`` bounds the staleness of every trained group: the fleet's allowance grows by the
sampled-per-trained ratio (more groups per version, not further ahead), and a group that still
arrives too late is dropped, never trained. At 2 answers a prompt about half the toy's groups have
no reward spread and are filtered, so the fleet samples about twice what the learner trains. Each arm
is a whole ``rlpipe demo`` in one run of this script; each reports the largest staleness trained,
the groups trained, filtered and dropped, and the workers' idle fraction. ``--loose`` adds the arms
with ``queue.max_staleness: 4``, the bound before it was hard, for the comparison.

    python -P bench/staleness_cost.py                 # max_lag 0 and 1, 12 steps each
    python -P bench/staleness_cost.py --steps 4       # a smoke run
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
    idle = [r["fleet_idle_fraction"] for r in rows if r.get("fleet_idle_fraction") is not None]
    return {"max_lag": max_lag, "max_staleness": max_staleness, "steps": len(rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "staleness_mean": round(sum(r["staleness_mean"] * r["groups"] for r in rows)
                                    / max(1, sum(r["groups"] for r in rows)), 3),
            "produced": produced, "trained": summary["groups_trained"], "filtered": summary["groups_filtered"],
            "dropped_stale": summary["groups_dropped_stale"],
            "dropped_fraction": round(summary["groups_dropped_stale"] / max(1, produced), 3),
            "rollout_idle_fraction": round(sum(idle) / len(idle), 3) if idle else None,
            "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> list[dict]:
    from rlpipe.machine import cpu_flags, cpu_name, simd_summary

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="learner steps of each arm")
    p.add_argument("--loose", action="store_true", help="also the arms at queue.max_staleness 4")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    print(f"{cpu_name()} ({simd_summary(cpu_flags())})", file=sys.stderr)
    bounds = [(0, None), (1, None)] + ([(0, 4), (1, 4)] if args.loose else [])
    with tempfile.TemporaryDirectory() as runs_dir:
        rows = [arm(lag, loose, args.steps, runs_dir) for lag, loose in bounds]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps({"machine": cpu_name(), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
