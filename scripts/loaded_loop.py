"""Run some tests round after round beside busy-loop hogs, and count the rounds that passed.

A test that passes on an idle machine may still fail on CI's loaded one (a deadline met
with a core to spare, an ordering that the load reverses). This runs the chosen tests
``--rounds`` times in a row with ``--hogs`` processes spinning on the CPUs, and writes one
line per round (``rounds.jsonl``: passed, failed, seconds, the failing tests) and a
summary, under ``--out``:

    python scripts/loaded_loop.py --rounds 20 --hogs 2 --out runs/loaded-loop -- \\
        tests/test_mixed_fleet.py tests/test_sync_faults.py tests/test_loop_faults.py

The arguments after ``--`` go to pytest as they are (add ``-m soak`` or ``-m ""`` for the soak
tests, such as tests/test_chaos.py). ``--minutes`` stops starting new rounds after that long.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOG = "while True: pass"


def run_round(pytest_args: list[str], junit: Path) -> dict:
    """One pytest run; its counts come from the last summary line, its failures from the ``FAILED`` lines."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                           f"--junitxml={junit}", *pytest_args], cwd=ROOT, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    last = out.splitlines()[-1] if out else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors)\b", last)}
    return {"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "passed": counts.get("passed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
            "failures": re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--hogs", type=int, default=2, help="busy-loop processes beside the tests")
    ap.add_argument("--minutes", type=float, default=0, help="start no round after this long (0: no limit)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "loaded-loop"))
    args = ap.parse_args(ours)
    if not pytest_args:
        ap.error("name the tests after --, as pytest takes them")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    rows, t_start = [], time.monotonic()
    try:
        with open(out / "rounds.jsonl", "w") as log:
            for k in range(1, args.rounds + 1):
                if args.minutes and time.monotonic() - t_start > args.minutes * 60:
                    print(f"[loaded-loop] --minutes {args.minutes:g} reached: {k - 1} rounds run", flush=True)
                    break
                row = {"round": k, **run_round(pytest_args, out / f"round{k}.xml")}
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"[loaded-loop] round {k}/{args.rounds}: {row['passed']} passed, {row['failed']} failed "
                      f"in {row['seconds']:.0f}s {' '.join(row['failures'])}", flush=True)
    finally:
        for h in hogs:
            h.kill()
    green = sum(1 for r in rows if r["rc"] == 0)
    summary = {"rounds": len(rows), "green": green, "hogs": args.hogs, "tests": pytest_args,
               "failures": sorted({f for r in rows for f in r["failures"]})}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[loaded-loop] {green} of {len(rows)} rounds green beside {args.hogs} hogs", flush=True)
    return 0 if rows and green == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
