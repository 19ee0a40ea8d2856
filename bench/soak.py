"""The soak tests: the suite's long experiments (a 30-step learning run, random faults,
random kill moments, a connection flood, fuzzing the API), marked ``soak`` and left out of
the default ``pytest`` run so that the suite fits CI's 40 minutes (pyproject.toml's
``addopts``). This part runs them in one pytest run and lists each with its outcome and
time; any failure fails the part. ``--quick`` only collects them: each still imports and
is found, and CI's quick report shows which they are.

    python bench/soak.py --json /tmp/soak.json     # or: pytest -m soak
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launch.results import Section  # noqa: E402

PYTEST = [sys.executable, "-m", "pytest", "-m", "soak", "-p", "no:cacheprovider", "-q"]


def collected() -> list[str]:
    out = subprocess.run([*PYTEST, "--collect-only"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"collecting the soak tests failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return [line for line in out.stdout.splitlines() if "::" in line]


def run() -> list[tuple[str, str, float]]:
    """(test id, outcome, seconds) of each soak test, from pytest's JUnit report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "soak.xml"
        subprocess.run([*PYTEST, f"--junitxml={report}"], cwd=ROOT, timeout=3 * 3600)
        if not report.exists():
            raise SystemExit("pytest wrote no report")
        rows = []
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").replace(".", "/") + ".py"
            outcome = next((tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None), "passed")
            rows.append((f"{module}::{case.get('name')}", outcome, float(case.get("time", 0))))
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="collect the soak tests, run none")
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "soak.json"))
    args = ap.parse_args(argv)
    sec = Section("soak", "Soak tests: the long experiments left out of CI's suite")
    if args.quick:
        rows = [(test, "collected (--quick runs none)", 0.0) for test in collected()]
    else:
        rows = run()
    sec.table("Each soak test", ["test", "outcome", "seconds"], [[t, o, round(s, 1)] for t, o, s in rows])
    failed = [t for t, o, _ in rows if o in ("failure", "error")]
    sec.notes.append(
        f"{len(rows)} tests, {sum(s for _, _, s in rows) / 60:.1f} minutes. They are the suite's long "
        "experiments, marked `soak`: `pytest` leaves them out (pyproject.toml's addopts) so that CI's suite "
        "stays within its 40 minutes, and `pytest -m soak` or this part runs them. Each is an experiment "
        "rather than a check of one decision: the decisions they touch have their own tests in the suite.")
    if not rows:
        raise SystemExit("no soak test found")
    path = sec.write(args.json)
    print(f"wrote {path}" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
