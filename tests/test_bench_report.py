"""rlpipe bench's report: sections from bench/ scripts rendered into results.md, in the report's
order, with what is missing or failed named; and its CLI's errors. (The scripts themselves
run in their own tests and, all together, in CI's `rlpipe bench --quick`.)"""

from __future__ import annotations

import subprocess
import sys

from launch import bench
from launch.results import Section, figure, load_section
from tests.conftest import ROOT


def write_section(json_dir, name, value):
    sec = Section(name, f"Title of {name}", command=f"python bench/{name}.py --x")
    sec.table("numbers", ["what", "|value|"], [["a", value], ["b", None]], note="a note under the table")
    fig, ((ax,),) = figure()
    ax.plot([1, 2, 3])
    sec.plot(fig, "curve", "a caption")
    sec.note("measured on CPU")
    sec.write(json_dir / f"{name}.json")


def test_the_report_renders_every_section_in_order_and_names_what_is_missing(tmp_path):
    json_dir = tmp_path / "results"
    write_section(json_dir, "queue", 0.25)
    write_section(json_dir, "weight_sync", 1234.5)  # written later, comes first in the report
    text = bench.render(tmp_path, failed={"async": "failed in the last run"}).read_text()
    assert text.index("## Title of weight_sync") < text.index("## Title of queue")
    assert "`python bench/queue.py --x`" in text and "| a | 0.25 |" in text and "| b | – |" in text
    assert "![a caption](results/queue_curve.png)" in text and (json_dir / "queue_curve.png").stat().st_size > 0
    assert "- [Title of queue](#title-of-queue)" in text
    assert "| what | \\|value\\| |" in text  # a pipe in a cell would split the markdown table
    assert "async (failed in the last run)" in text and "learner (not run yet)" in text
    assert set(bench.ORDER) == {s for p in bench.PARTS for s in p.sections} | set(bench.BY_HAND)


def test_a_section_refuses_a_ragged_table_and_a_file_that_is_not_one(tmp_path):
    sec = Section("x", "X")
    try:
        sec.table("t", ["a", "b"], [[1]])
    except ValueError as e:
        assert "every row needs 2 cells" in str(e)
    else:
        raise AssertionError("a ragged table was accepted")
    (tmp_path / "y.json").write_text('{"name": "y"}')
    try:
        load_section(tmp_path / "y.json")
    except ValueError as e:
        assert "not a results section (no 'title')" in str(e)
    else:
        raise AssertionError("a file that is not a section was loaded")


def test_the_cli_names_an_unknown_part_and_every_part_script_exists(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "--only", "queue,nope", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--only: unknown part(s) ['nope']" in proc.stderr
    for part in bench.PARTS:
        assert (ROOT / part.script).exists(), part.script
        cmd = part.command(quick=True, json_dir=tmp_path)
        assert cmd[-2] in ("--json", "--json-dir") and str(tmp_path) in cmd[-1]
    ok = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "--render-only", "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert ok.returncode == 0 and (tmp_path / "results.md").read_text().startswith("# rlpipe: results")


def test_quick_runs_two_lanes_and_a_part_reading_anothers_run_follows_it_in_its_lane():
    """``--quick`` runs two parts at a time (CI: 703 s one after another, over its 10
    minutes); a part that reports another's quick run instead of training one must come
    after it, in the same lane, or it reads nothing (or a stale run)."""
    from bench.seeds import FINDINGS
    parts = list(bench.PARTS)
    assert bench.lanes(parts, quick=False) == [parts]  # the full run's times are measured alone
    lanes = bench.lanes(parts, quick=True)
    assert len(lanes) == 2 and sorted(p.name for lane in lanes for p in lane) == sorted(p.name for p in parts)
    where = {p.name: (i, j) for i, lane in enumerate(lanes) for j, p in enumerate(lane)}
    delta = next(p for p in parts if p.name == "delta_sync")
    reads = {"delta_sync": "int8"} | {name: f.quick_from for name, f in FINDINGS.items() if f.quick_from}
    assert "runs/seeds/int8/" in " ".join(delta.quick) and len(reads) >= 4
    part_of = {section: p.name for p in parts for section in p.sections}  # a part may run several findings
    for finding, source in reads.items():
        part = part_of.get(finding, finding)
        assert where[part][0] == where[source][0] and where[part][1] > where[source][1], (part, source)
    # the two parts that load SmolLM2 in their own processes are apart in time: calibration first
    assert where["real-int8"] == (1, 0) and where["real"][0] == 0
