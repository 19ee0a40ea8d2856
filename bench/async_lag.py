"""Async vs sync, measured fairly: each role on cores of its own, the same config at several
``queue.max_lag``, and the async speedup against its physical limit.

Each run is a whole ``rlpipe demo`` (Redis, one rollout worker and the learner as separate
processes) with the worker pinned to ``--rollout-cpus`` (core 0) and the learner to
``--learner-cpus`` (core 1, one thread), so neither waits for the other's core and the only
thing that changes between runs is ``max_lag`` (0 = synchronous). Runs go seed by seed,
the lags in alternating order (0,1,2,4 then 4,2,1,0), so a drift of the machine's speed
hits every lag. Over the steps after ``--warmup`` each run gives:

    steps per hour      3600 / wall seconds per step
    learner idle        wait / (wait + step): learner_wait_seconds against learner_step_seconds
    rollout idle        the fleet's rollout_idle_seconds_total (no group in flight) / (workers x wall)
    R, L                rollout and learner busy time per step: R = wall minus the worker's idle time,
                        per step; L = learner_step_seconds (train + sync + checkpoint)
    speedup             sync's wall per step / this run's, same seed
    limit               (R + L) / max(R, L), with R and L of the same seed's sync run (max_lag 0):
                        what perfect pipelining of those two would give; goal: speedup >= 0.9 x limit
    reward, mismatch    reward (last 5 steps, all runs the same steps), mismatch KL of all groups and
                        of the staleness-0 groups alone (mismatch_kl_fresh): precision vs policy lag

Writes two ``launch.results`` sections to ``--json-dir``: ``async.json`` (tables, reward vs
wall-clock, speedup vs limit) and ``attribution.json`` (mismatch KL at each lag, all groups
vs staleness 0, per seed, and over steps). Runs stay in ``--out``; ``--from-runs`` redoes
the sections from them without training.

    python bench/async_lag.py                          # lags 0,1,2,4 x seeds 0,1, 40 steps (the lead's run)
    python bench/async_lag.py --quick --json-dir /tmp/async   # CI smoke: lags 0,1, 1 seed, 3 small steps
    python bench/async_lag.py --from-runs              # redo the sections from runs/async_lag
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch.results import Section, figure  # noqa: E402

QUICK = {"lags": "0,1", "seeds": "0", "steps": 3, "warmup": 1,  # CI's smoke: its numbers mean nothing
         "set": {"learner.groups_per_step": 8, "learner.checkpoint_every": 100}}


def say(msg: str) -> None:
    print(f"[async_lag] {msg}", file=sys.stderr, flush=True)


def fmean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(values) if values else float("nan")


# --- one run ------------------------------------------------------------------------------------

def run_stats(rows: list[dict], warmup: int) -> dict:
    """The numbers of one run over its steps after ``warmup`` (the first rows include start-up
    and the first syncs). Window: from the end of step ``warmup`` to the end of the last step."""
    base, window = rows[warmup - 1], rows[warmup:]
    n = len(window)
    wall = window[-1]["time"] - base["time"]
    workers = window[-1].get("rollout_workers") or 1
    idle = window[-1]["rollout_idle_seconds_total"] - base["rollout_idle_seconds_total"]
    wait = sum(r["learner_wait_seconds"] for r in window)
    busy = sum(r["learner_step_seconds"] for r in window)
    fresh = sum(r.get("staleness_hist", {}).get("0", 0) for r in window)
    groups = sum(sum(r.get("staleness_hist", {}).values()) for r in window)
    return {
        "steps": len(rows), "window": n,
        "wall_per_step": wall / n,
        "steps_per_hour": 3600 * n / wall,
        "learner_idle": wait / (wait + busy),
        "rollout_idle": idle / (workers * wall),
        "R": (wall - idle / workers) / n,  # the fleet's busy time per step
        "L": busy / n,
        "wait_per_step": wait / n,
        "pipelining": max(wall - idle / workers, busy) / wall,  # max(R, L) / wall: 1 = the slower role never waits
        "reward_end": fmean(r["reward_mean"] for r in rows[-5:]),
        "reward_mean": fmean(r["reward_mean"] for r in window),
        "kl": fmean(r["mismatch_kl"] for r in window),
        "kl_fresh": fmean(r.get("mismatch_kl_fresh") for r in window),
        "fresh_share": fresh / groups if groups else float("nan"),
        "staleness_mean": fmean(r["staleness_mean"] for r in window),
    }


class Placement:
    """Which cores every process (every thread) of each role may run on, sampled during a
    run from /proc: a role is named by its ``launch.cli <role>`` ancestor (the vLLM engine
    process and torchrun's ranks count as their role's), redis-server as ``redis``."""

    def __init__(self):
        self.seen: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        import psutil

        while not self._stop.wait(2.0):
            for proc in psutil.Process().children(recursive=True):
                try:
                    role = self._role(proc)
                    allowed = set()
                    for tid in os.listdir(f"/proc/{proc.pid}/task"):
                        for line in open(f"/proc/{proc.pid}/task/{tid}/status"):
                            if line.startswith("Cpus_allowed_list:"):
                                allowed.add(line.split(":", 1)[1].strip())
                    ran_on = proc.cpu_num()
                except (psutil.Error, OSError):
                    continue
                if role:
                    entry = self.seen.setdefault(role, {"pids": set(), "allowed": set(), "ran_on": set()})
                    entry["pids"].add(proc.pid)
                    entry["allowed"] |= allowed
                    entry["ran_on"].add(ran_on)

    @staticmethod
    def _role(proc) -> str:
        for p in [proc, *proc.parents()]:
            cmd = p.cmdline()
            if "launch.cli" in cmd:
                return cmd[cmd.index("launch.cli") + 1]
            if p.name().startswith("redis-server"):
                return "redis"
        return ""

    def summary(self) -> str:
        return "; ".join(f"{role}: {len(e['pids'])} processes, allowed cores {'/'.join(sorted(e['allowed']))}, "
                         f"seen on {sorted(e['ran_on'])}" for role, e in sorted(self.seen.items()))


def run_one(run_id: str, seed: int, lag: int, args, common: dict, runs_dir: Path) -> tuple[list[dict], str]:
    """Train (unless --from-runs) and return the run's metrics rows and its observed placement."""
    from learner.metrics import read_jsonl

    run_dir = runs_dir / run_id
    placement = ""
    if not args.from_runs:
        from launch.demo import run_demo
        from rlpipe.config import build_config

        shutil.rmtree(run_dir, ignore_errors=True)  # an old run's Redis AOF and metrics would be read again
        cfg = build_config({}, environ={}, seed=seed, run_id=run_id, **{**common, "queue.max_lag": lag})
        with Placement() as watch:
            summary = run_demo(cfg, runs_dir=str(runs_dir), progress=False, timeout_s=args.timeout)
        placement = watch.summary()
        (run_dir / "placement.txt").write_text(placement + "\n")
        if not summary.get("completed"):
            raise SystemExit(f"run {run_id} did not complete: see {run_dir}/logs")
    elif (run_dir / "placement.txt").exists():
        placement = (run_dir / "placement.txt").read_text().strip()
    return read_jsonl(run_dir / "metrics.jsonl"), placement


# --- the sections -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lags", default="0,1,2,4", help="queue.max_lag values; 0 (sync) is always run")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of every per-run number")
    ap.add_argument("--rollout-cpus", default="0", help="rollout.cpus: the worker's cores")
    ap.add_argument("--learner-cpus", default="1", help="learner.cpus: the learner's cores")
    ap.add_argument("--quick", action="store_true", help="CI smoke: lags 0,1, seed 0, 3 steps of 8 groups")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for every run")
    ap.add_argument("--out", help="runs directory (default runs/async_lag, or runs/async_lag_quick)")
    ap.add_argument("--json-dir", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    ap.add_argument("--from-runs", action="store_true", help="redo the sections from the runs in --out")
    args = ap.parse_args(argv)
    extra = {}
    if args.quick:
        args.lags, args.seeds, args.steps, args.warmup = QUICK["lags"], QUICK["seeds"], QUICK["steps"], QUICK["warmup"]
        extra.update(QUICK["set"])
    for item in args.set:
        key, _, value = item.partition("=")
        extra[key] = yaml.safe_load(value)
    if not 1 <= args.warmup < args.steps:
        raise SystemExit("--warmup: must be at least 1 and below --steps")
    runs_dir = Path(args.out or ROOT / "runs" / ("async_lag_quick" if args.quick else "async_lag")).resolve()
    lags = sorted({0, *(int(x) for x in args.lags.split(","))})
    seeds = [int(x) for x in args.seeds.split(",")]
    common = {"steps": args.steps, "workers": 1, "rollout.cpus": args.rollout_cpus, "learner.cpus": args.learner_cpus,
              "learner.threads": 1, **extra}

    stats: dict[tuple[int, int], dict] = {}
    curves: dict[tuple[int, int], list[dict]] = {}
    placements: list[str] = []
    order = [(seed, lag) for i, seed in enumerate(seeds) for lag in (lags if i % 2 == 0 else lags[::-1])]
    t_all = time.monotonic()
    for k, (seed, lag) in enumerate(order, 1):
        run_id = f"lag{lag}-s{seed}"
        say(f"run {k}/{len(order)}: {run_id} (max_lag {lag}, seed {seed}, {args.steps} steps)")
        t0 = time.monotonic()
        rows, placement = run_one(run_id, seed, lag, args, common, runs_dir)
        if len(rows) <= args.warmup:
            raise SystemExit(f"run {run_id}: {len(rows)} steps, not enough after --warmup {args.warmup}")
        curves[seed, lag], stats[seed, lag] = rows, run_stats(rows, args.warmup)
        s = stats[seed, lag]
        placements.append(f"{run_id}: {placement}" if placement else "")
        say(f"  {run_id} done in {time.monotonic() - t0:.0f}s: {s['steps_per_hour']:.0f} steps/h, "
            f"learner idle {s['learner_idle']:.2f}, rollout idle {s['rollout_idle']:.2f}, KL {s['kl']:.2e}"
            + (f"\n  placement: {placement}" if placement else ""))
    say(f"all {len(order)} runs in {time.monotonic() - t_all:.0f}s")
    for seed in seeds:  # speedup and limit against the same seed's sync run
        sync = stats[seed, 0]
        limit = (sync["R"] + sync["L"]) / max(sync["R"], sync["L"])
        for lag in lags:
            s = stats[seed, lag]
            s["speedup"] = sync["wall_per_step"] / s["wall_per_step"]
            s["limit"] = limit
            s["gain_captured"] = (s["speedup"] - 1) / (limit - 1) if lag and limit > 1 else float("nan")
            s["of_limit_ratio"] = s["speedup"] / limit

    json_dir = Path(args.json_dir)
    settings = (f"{args.steps} steps, seeds {','.join(map(str, seeds))}, 1 worker on cores {args.rollout_cpus}, "
                f"learner on cores {args.learner_cpus} (1 thread); per-run numbers over steps {args.warmup + 1}-"
                f"{args.steps}" + (f"; {', '.join(f'{k}={v}' for k, v in extra.items())}" if extra else ""))
    async_section(stats, curves, seeds, lags, settings, [p for p in placements if p]).write(json_dir / "async.json")
    attribution_section(stats, curves, seeds, lags, settings).write(json_dir / "attribution.json")
    say(f"wrote {json_dir / 'async.json'} and {json_dir / 'attribution.json'}")
    return stats


def spread(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{statistics.fmean(values):.3g}" + (f" ({lo:.3g}–{hi:.3g})" if len(values) > 1 else "")


def lag_curves(curves, seeds, lags):
    """Each run's metrics rows for the plots, max_lag by max_lag (one colour each) and seed by
    seed: (max_lag, rows, line style, whether it is the first seed's). The first seed's line is
    drawn bold and labelled, the other seeds' faint in the same colour."""
    for i, lag in enumerate(lags):
        for j, seed in enumerate(seeds):
            yield lag, curves[seed, lag], {"color": f"C{i}", "alpha": 0.9 if j == 0 else 0.35}, j == 0


def async_section(stats, curves, seeds, lags, settings, placements) -> Section:
    sec = Section("async", "Async vs sync on dedicated cores")
    sec.table(
        "By max_lag (mean over seeds, range in brackets)",
        ["max_lag", "steps/h", "speedup vs sync", "limit (R+L)/max(R,L)", "speedup / limit", "gain captured",
         "learner idle",
         "rollout idle", "reward, last 5 steps", "mismatch KL"],
        [[lag, spread([stats[s, lag]["steps_per_hour"] for s in seeds]),
          spread([stats[s, lag]["speedup"] for s in seeds]), spread([stats[s, lag]["limit"] for s in seeds]),
          spread([stats[s, lag]["of_limit_ratio"] for s in seeds]) if lag else "–",
          spread([stats[s, lag]["gain_captured"] for s in seeds]) if lag else "–",
          spread([stats[s, lag]["learner_idle"] for s in seeds]), spread([stats[s, lag]["rollout_idle"] for s in seeds]),
          spread([stats[s, lag]["reward_end"] for s in seeds]), spread([stats[s, lag]["kl"] for s in seeds])]
         for lag in lags],
        note="Goal: speedup / limit >= 0.9 at equal reward per step (every run trains the same steps). Gain "
             "captured, (speedup - 1) / (limit - 1), is the stricter view: the share of the possible gain obtained.")
    sec.table(
        "Per run",
        ["max_lag", "seed", "s/step", "steps/h", "learner idle", "rollout idle", "R s", "L s", "max(R,L) / wall",
         "speedup", "limit", "speedup / limit", "reward, last 5", "reward, mean", "mismatch KL"],
        [[lag, seed, s["wall_per_step"], s["steps_per_hour"], s["learner_idle"], s["rollout_idle"], s["R"], s["L"],
          s["pipelining"], s["speedup"], s["limit"], s["of_limit_ratio"] if lag else None, s["reward_end"],
          s["reward_mean"], s["kl"]]
         for seed in seeds for lag in lags for s in [stats[seed, lag]]],
        note="R: the worker's busy time per step (wall minus its idle time, rlpipe_rollout_idle_seconds_total); "
             "L: learner_step_seconds (train + weight sync + checkpoint). The limit uses R and L of the same seed's "
             "max_lag 0 run. max(R,L) / wall is how close the run itself comes to perfect pipelining of its own "
             "R and L; it does not depend on the sync run, whose per-step hand-over (next table) the limit leaves "
             "out, so a speedup can exceed the limit.")
    sec.table(
        "The sync runs: is the learner's wait the rollout time?",
        ["seed", "learner wait/step s", "R s", "wait - R s", "L s", "R + L s", "wall/step s", "wall - (R+L) s"],
        [[seed, s["wait_per_step"], s["R"], s["wait_per_step"] - s["R"], s["L"], s["R"] + s["L"], s["wall_per_step"],
          s["wall_per_step"] - s["R"] - s["L"]] for seed in seeds for s in [stats[seed, 0]]],
        note="In sync mode the learner waits while the worker generates: wait - R is the hand-over cost (the "
             "worker noticing the new weights, leasing, the last push reaching the learner); wall - (R+L) the "
             "per-step cost outside both.")
    fig, axes = figure(2, 1, width=6.2)
    ax = axes[0][0]
    for lag, rows, style, first in lag_curves(curves, seeds, lags):
        t0 = rows[0]["time"]
        ax.plot([r["time"] - t0 for r in rows], [r["reward_mean"] for r in rows], **style,
                linewidth=1.6 if first else 1.0, label=f"max_lag {lag}" if first else None)
    ax.set(xlabel="seconds since the first step", ylabel="mean reward (sampled)", title="reward vs wall-clock")
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[0][1]
    async_lags = [lag for lag in lags if lag]
    x = range(len(async_lags))
    for off, key, label, color in ((-0.2, "speedup", "measured speedup", "C0"), (0.2, "limit", "limit (R+L)/max(R,L)", "C7")):
        means = [fmean(stats[s, lag][key] for s in seeds) for lag in async_lags]
        lo = [m - min(stats[s, lag][key] for s in seeds) for m, lag in zip(means, async_lags)]
        hi = [max(stats[s, lag][key] for s in seeds) - m for m, lag in zip(means, async_lags)]
        ax.bar([i + off for i in x], means, width=0.4, yerr=[lo, hi], capsize=3, color=color, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), [f"max_lag {lag}" for lag in async_lags])
    ax.set(ylabel="x sync steps/h", title="async speedup vs its limit (mean, seed range)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    sec.plot(fig, "reward_speedup", "left: reward over wall-clock time per max_lag (first seed bold, others "
             "faint); right: speedup over the same seed's sync run against (R+L)/max(R,L)")
    sec.note(f"Settings: {settings}. Each run is `rlpipe demo` with `rollout.cpus`/`learner.cpus`, so neither "
             "role runs on the other's core; runs alternate the order of lags from seed to seed.")
    if placements:  # runs with the same placement (the rule) named together
        runs_by_text: dict[str, list[str]] = {}
        for p in placements:
            run, _, text = p.partition(": ")
            runs_by_text.setdefault(text, []).append(run)
        sec.note("Observed placement (every thread's Cpus_allowed_list, sampled every 2 s): " + " | ".join(
            f"{', '.join(runs)}: {text}" for text, runs in runs_by_text.items()))
    return sec


def attribution_section(stats, curves, seeds, lags, settings) -> Section:
    sec = Section("attribution", "Mismatch attribution: precision vs one version of policy lag")
    sec.table(
        "By max_lag (mean over seeds, range in brackets)",
        ["max_lag", "mismatch KL, all groups", "mismatch KL, staleness-0 groups", "staleness-0 share",
         "staleness mean"],
        [[lag, spread([stats[s, lag]["kl"] for s in seeds]), spread([stats[s, lag]["kl_fresh"] for s in seeds]),
          spread([stats[s, lag]["fresh_share"] for s in seeds]), spread([stats[s, lag]["staleness_mean"] for s in seeds])]
         for lag in lags])
    sec.table(
        "Per run",
        ["max_lag", "seed", "KL all", "KL staleness 0", "all / staleness 0", "staleness-0 share", "staleness mean"],
        [[lag, seed, s["kl"], s["kl_fresh"], s["kl"] / s["kl_fresh"] if s["kl_fresh"] > 0 else None,
          s["fresh_share"], s["staleness_mean"]] for seed in seeds for lag in lags for s in [stats[seed, lag]]],
        note="mismatch_kl: per-token KL between the rollout's log-probs (bf16 vLLM) and the learner's recomputed "
             "ones (fp32), mean over the steps; staleness 0: the groups trained by the version that generated "
             "them (mismatch_kl_fresh), i.e. precision alone; the rest adds one or more versions of policy lag.")
    fig, axes = figure(1, 1, width=7.5)
    ax = axes[0][0]
    for lag, rows, style, first in lag_curves(curves, seeds, lags):
        ax.plot([r["step"] for r in rows], [r["mismatch_kl"] for r in rows], **style,
                label=f"max_lag {lag}, all groups" if first else None)
        fresh = [(r["step"], r["mismatch_kl_fresh"]) for r in rows if r.get("mismatch_kl_fresh") is not None]
        if fresh and lag:
            ax.plot(*zip(*fresh), **style, linestyle="--", label=f"max_lag {lag}, staleness 0" if first else None)
    ax.set(xlabel="learner step", ylabel="mismatch KL per token", yscale="log",
           title="mismatch KL: all groups (solid) vs staleness-0 groups (dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    sec.plot(fig, "kl_over_steps", "mismatch KL over steps per max_lag (first seed bold, others faint); "
             "non-positive per-step estimates are not drawn on the log scale")
    sec.note(f"Settings: {settings}. At max_lag 0 every group is staleness 0, so its KL is the precision's "
             "alone; at max_lag >= 1 the staleness-0 groups of the same run measure precision, and the "
             "difference to all groups is what one (or more) version of policy lag adds.")
    return sec


if __name__ == "__main__":
    main()
