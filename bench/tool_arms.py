"""Token-exact against re-tokenized tool episodes in RL, with token-level and sequence-level correction.

bench/tool_tokens.py measures, on answers sampled once, what a trainer that tokenizes an episode's
text again would train. This runs it: the calculator recipe (configs/smollm2-calc.yaml) for 30 steps
on one seed in four arms,

- **token-exact** (rlpipe's sessions: the ids the engine saw) or **re-tokenized**
  (``learner.retokenize``: each answer's text tokenized again on the learner, learner/retokenize.py),
- each with **token_tis** (per-token truncated IS) or **seq_tis** (one truncated weight a sequence),

and reports, per arm, held-out accuracy with the tool (paired against the base model's answers on the
same rows), the rollout-training mismatch over the run, how many trained tokens the re-tokenizing
changed, and signs of collapse (the entropy, the gradient norm, the IS weights' effective sample size).

    python -P bench/tool_arms.py --runs-dir runs                    # the four arms, about 2 hours on 2 cores
    python -P bench/tool_arms.py --runs-dir runs --only exact-seq   # one arm
    python -P bench/tool_arms.py --runs-dir runs --json docs/results/tool-arms.json   # then the report section

A finished arm (its ``summary.json`` in ``<runs-dir>/arm-<name>``) is not run again. All arms set
``queue.max_staleness: 4``, so that they compare with the recipe's earlier 30-step run of this seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = {  # name -> (label, extra demo flags)
    "exact-token": ("token-exact, token_tis", ["--is-mode", "token_tis"]),
    "exact-seq": ("token-exact, seq_tis", ["--is-mode", "seq_tis"]),
    "retok-token": ("re-tokenized, token_tis", ["--is-mode", "token_tis", "--set", "learner.retokenize=true"]),
    "retok-seq": ("re-tokenized, seq_tis", ["--is-mode", "seq_tis", "--set", "learner.retokenize=true"]),
}
STEPS, SEED = 30, 1


def demo_command(name: str, runs_dir: Path) -> list[str]:
    return [sys.executable, "-m", "launch.cli", "demo", "--config", "configs/smollm2-calc.yaml", "--seed", str(SEED),
            "--steps", str(STEPS), "--set", "queue.max_staleness=4", "--set", "eval.exported=false",
            "--run-id", f"arm-{name}", "--runs-dir", str(runs_dir), *ARMS[name][1]]


def run_demo_arm(name: str, run_id: str, runs_dir: Path, command: list[str]) -> None:
    """Run one arm's ``rlpipe demo`` ``command`` (run id ``run_id``) with its log beside its run
    directory, unless a finished run (its ``summary.json``) is there already."""
    run_dir = runs_dir / run_id
    if (run_dir / "summary.json").exists():
        print(f"{name}: done already ({run_dir})", file=sys.stderr)
        return
    runs_dir.mkdir(parents=True, exist_ok=True)
    log = runs_dir / f"{run_id}.log"
    print(f"{name}: running, log in {log}", file=sys.stderr)
    with open(log, "w") as f:
        subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)


def run_arm(name: str, runs_dir: Path) -> None:
    run_demo_arm(name, f"arm-{name}", runs_dir, demo_command(name, runs_dir))


def arm_row(name: str, runs_dir: Path, earlier: Path | None = None) -> dict | None:
    """One arm's numbers from its run directory; or, with ``earlier``, from an earlier run's summary
    alone (its per-step columns empty)."""
    from learner.metrics import read_jsonl

    run_dir = runs_dir / f"arm-{name}"
    summary = run_dir / "summary.json" if (run_dir / "summary.json").exists() else earlier
    if summary is None or not summary.exists():
        return None
    s = json.loads(summary.read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl") if summary.parent == run_dir else []
    col = lambda key: [r[key] for r in rows if isinstance(r.get(key), (int, float))]  # noqa: E731
    tokens = sum(col("tokens")) or None
    changed = sum(col("retokenized_changed_tokens"))
    label = ARMS[name][0] + ("" if summary.parent == run_dir else f" (an earlier run: {summary.name})")
    return {"arm": label, "steps": s.get("steps"), "paired_with_tool": s.get("eval_paired_strict"),
            "paired_without_tool": s.get("eval_paired_without_tool"), "reward": [s.get("reward_start"),
                                                                                  s.get("reward_end")],
            "mismatch_kl_mean": s.get("mismatch_kl_mean"), "mismatch_kl_max": max(col("mismatch_kl"), default=None),
            "seq_kl_mean": statistics.mean(col("mismatch_seq_kl")) if col("mismatch_seq_kl") else None,
            "changed_per_1000": None if not tokens else round(1000 * changed / tokens, 2),
            "entropy_first_last": _ends(col("entropy")), "grad_norm_max": max(col("learner_grad_norm"), default=None),
            "is_ess_min": min(col("is_ess"), default=None),
            "skipped_steps": max(col("learner_skipped_steps_total"), default=None), "wall_minutes": round(s.get("wall_seconds", 0) / 60, 1),
            "machine": s.get("machine")}


def _ends(values: list[float]) -> list[float] | None:
    """The mean of the first 5 values and of the last 5."""
    return [round(statistics.mean(values[:5]), 4), round(statistics.mean(values[-5:]), 4)] if values else None


def section(rows: dict[str, dict]):
    from launch.results import Section

    sec = Section("tool-arms", "Token-exact against re-tokenized tool episodes in RL (SmolLM2, in-turn calculator)",
                  "python -P bench/tool_arms.py --runs-dir runs --json docs/results/tool-arms.json")
    sec.table(f"The calculator recipe, {STEPS} steps, seed {SEED}, each arm: held-out SingleEq (455 rows, greedy), "
              "the served policy against the base model", ["arm", "with the tool", "without the tool",
                                                           "training reward, start -> end"],
              [[r["arm"], r["paired_with_tool"], r["paired_without_tool"],
                f"{r['reward'][0]:.3f} -> {r['reward'][1]:.3f}"] for r in rows.values()])
    sec.table("Mismatch and stability over the run", ["arm", "mismatch k1 a token, mean", "max", "a sequence, mean", "changed tokens "
              "per 1,000 trained", "entropy, first 5 -> last 5 steps", "grad norm, max", "IS ESS, min", "minutes"],
              [[r["arm"], r["mismatch_kl_mean"], r["mismatch_kl_max"], r["seq_kl_mean"], r["changed_per_1000"],
                None if not r["entropy_first_last"] else " -> ".join(f"{v:.3f}" for v in r["entropy_first_last"]),
                r["grad_norm_max"], r["is_ess_min"], r["wall_minutes"]] for r in rows.values()])
    machines = sorted({r["machine"] for r in rows.values() if r["machine"]})
    sec.note(f"On {'; '.join(machines)}. Each arm is `rlpipe demo --config configs/smollm2-calc.yaml --seed {SEED} "
             f"--steps {STEPS} --set queue.max_staleness=4 --set eval.exported=false` plus its flags "
             "(`--is-mode`, `--set learner.retokenize=true`); the wall minutes include the base model's "
             "evaluation where the cache did not hold it, and the end's.")
    measured = [r for r in rows.values() if r["entropy_first_last"]]
    broke = [r["arm"] for r in measured if r["entropy_first_last"][1] < 0.1 * r["entropy_first_last"][0]
             or (r["grad_norm_max"] or 0) > 10]
    sec.note(("Collapsed (the entropy below a tenth of its start, or a gradient norm above 10): "
              + ", ".join(broke)) if broke else
             f"No arm collapsed: in the {len(measured)} arms run here the entropy fell from "
             f"{min(r['entropy_first_last'][0] for r in measured):.2f}-{max(r['entropy_first_last'][0] for r in measured):.2f}"
             f" to {min(r['entropy_first_last'][1] for r in measured):.2f}-{max(r['entropy_first_last'][1] for r in measured):.2f}"
             f" (as the training reward rose), the largest gradient norm was "
             f"{max(r['grad_norm_max'] for r in measured):.2f}, and "
             f"{sum(r['skipped_steps'] or 0 for r in measured)} steps were skipped for a non-finite gradient.")
    sec.note("One seed of 30 steps an arm: the same recipe's two full-length seeds differ by 2 points, and a "
             "30-step run moves less, so a difference of a few points between two arms here is not evidence; "
             "the mismatch columns and the changed-token counts are the comparison.")
    sec.data = rows
    return sec


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs", help="where the arms' run directories go")
    p.add_argument("--only", default="", help=f"comma-separated arms, of {', '.join(ARMS)}")
    p.add_argument("--report-only", action="store_true", help="run nothing: report the finished arms")
    p.add_argument("--json", type=Path, help="write the results section here")
    p.add_argument("--earlier", action="append", default=[], metavar="ARM=SUMMARY",
                   help="report an arm not run here from an earlier run's summary.json of the same settings")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(ARMS)
    bad = [n for n in names if n not in ARMS]
    if bad:
        p.error(f"--only: unknown arm(s) {bad}; choose from {list(ARMS)}")
    if not args.report_only:
        for name in names:
            run_arm(name, args.runs_dir)
    earlier = dict(e.split("=", 1) for e in args.earlier)
    rows = {n: r for n in ARMS if (r := arm_row(n, args.runs_dir, Path(earlier[n]) if n in earlier else None))}
    print(json.dumps(rows, indent=1))
    if args.json and rows:
        section(rows).write(args.json)
    return rows


if __name__ == "__main__":
    main()
