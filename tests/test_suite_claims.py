"""What the README and the quickstart tell a reader about the test suite agrees between the two, and
with the suite: the same count of tests and the same minutes, and the count within a tenth of what
pytest collects now (a suite that grew or shrank by more has its pages updated with it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLAIM = re.compile(r"about ([\d,]+) tests(?:[^.]*?) ([\d.]+) minutes on", re.S)


def claims(path: Path) -> set[tuple[int, float]]:
    text = " ".join(path.read_text(encoding="utf-8").split())
    return {(int(n.replace(",", "")), float(m)) for n, m in CLAIM.findall(text)}


def test_the_readme_and_the_quickstart_state_the_same_suite_and_it_is_this_one():
    readme, quickstart = claims(ROOT / "README.md"), claims(ROOT / "docs" / "quickstart.md")
    assert readme and readme == quickstart, (readme, quickstart)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    collected = int(re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", out).group(1))
    (count, _), = readme
    assert abs(count - collected) <= 0.1 * collected, (count, collected)
