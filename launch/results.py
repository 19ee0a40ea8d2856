"""The evidence report's one format: every ``bench/`` script writes a *section* (JSON: its
tables, plots and notes, and the exact command that produced them), and ``rlpipe bench``
renders the sections into ``docs/results.md``.

A script builds a :class:`Section`, adds tables, plots and notes as it measures, and
writes it to its ``--json`` path; plots go into the same directory, named after the
section, so a section's JSON and PNGs travel together::

    sec = Section("queue", "Queue: serialization and Redis per group")
    sec.table("Per group", ["tokens", "encode ms"], [[1024, 0.4]], note="median of 50")
    sec.plot(fig, "per_group", "what the plot shows")
    sec.note("what was measured on CPU, and what would differ on GPUs")
    sec.write(args.json)
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def this_command() -> str:
    """The command line that ran this script, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    root = str(ROOT) + os.sep
    args = [a.replace(root, "") for a in sys.argv[1:]]  # paths in the repository, as typed from its root
    return shlex.join(["python", str(script), *args])


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.2e}"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


class Section:
    def __init__(self, name: str, title: str, command: str | None = None):
        self.name, self.title = name, title
        self.command = command or this_command()
        self.tables: list[dict] = []
        self.plots: list[dict] = []
        self.notes: list[str] = []
        self.data = None  # the raw numbers behind the tables, for whoever wants to compute more
        self._pending_figures: list[tuple[object, str]] = []

    def table(self, title: str, columns: list[str], rows: list[list], note: str = "") -> None:
        if any(len(r) != len(columns) for r in rows):
            raise ValueError(f"table {title!r}: every row needs {len(columns)} cells")
        self.tables.append({"title": title, "columns": list(columns), "rows": [list(r) for r in rows], "note": note})

    def plot(self, fig, name: str, caption: str = "") -> None:
        """A matplotlib figure, saved as ``<section>_<name>.png`` next to the JSON when written."""
        file = f"{self.name}_{name}.png"
        self._pending_figures.append((fig, file))
        self.plots.append({"file": file, "caption": caption})

    def note(self, text: str) -> None:
        self.notes.append(text)

    def to_dict(self) -> dict:
        return {"name": self.name, "title": self.title, "command": self.command, "tables": self.tables,
                "plots": self.plots, "notes": self.notes, "data": self.data, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                "machine": machine()}

    def write(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for fig, file in self._pending_figures:
            fig.savefig(path.parent / file, dpi=110, bbox_inches="tight")
            import matplotlib.pyplot as plt

            plt.close(fig)
        self._pending_figures = []
        path.write_text(json.dumps(self.to_dict(), indent=1, default=float))
        return path


def machine() -> str:
    """What the numbers were measured on: cores this process may use, and CPU model or GPU."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = ", " + torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"{len(os.sched_getaffinity(0))} cores ({cpu or 'unknown CPU'}){gpu}"


def figure(ncols: int = 1, nrows: int = 1, width: float = 5.5, height: float = 3.8):
    """A matplotlib figure and its axes, with the headless backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)


def render_section(sec: dict, link_dir: str = "") -> str:
    """Markdown for one section: title, command, tables, plots, notes."""
    out = [f"## {sec['title']}", "", f"`{sec['command']}`  ", f"_{sec.get('written', '')} on {sec.get('machine', '')}_", ""]
    for t in sec["tables"]:
        out += [f"**{t['title']}**", "", "| " + " | ".join(c.replace("|", "\\|") for c in t["columns"]) + " |",
                "|" + "---|" * len(t["columns"])]
        out += ["| " + " | ".join(_cell(v).replace("|", "\\|") for v in row) + " |" for row in t["rows"]]
        out += ["", t["note"], ""] if t.get("note") else [""]
    for p in sec["plots"]:
        out += [f"![{p['caption'] or p['file']}]({link_dir}{p['file']})", ""]
        if p.get("caption"):
            out += [f"_{p['caption']}_", ""]
    for n in sec["notes"]:
        out += [n, ""]
    return "\n".join(out)


def load_section(path: str | os.PathLike) -> dict:
    sec = json.loads(Path(path).read_text())
    for key in ("name", "title", "command", "tables", "plots", "notes"):
        if key not in sec:
            raise ValueError(f"{path}: not a results section (no {key!r})")
    return sec
