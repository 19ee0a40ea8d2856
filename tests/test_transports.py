"""Each weight-sync transport defined once (rlpipe/transports.py): the docs' table is its rows,
the config's values are its names, no product file lists or branches on transport names, and
a new row is honoured by every rule (choice, refusals, engine arguments, the engine's
transfer backend, the module) with no other file touched."""

from __future__ import annotations

import ast
import typing
from dataclasses import replace
from pathlib import Path

import pytest

from rlpipe import transports
from rlpipe.config import SyncConfig
from rlpipe.transports import SPECS, TRANSPORTS, TransportSpec

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("rlpipe", "weight_sync", "launch", "rollout_service", "learner", "quant", "bench", "scripts")


def doc_table() -> list[list[str]]:
    """The rows of docs/weight-sync.md's transport table (the one headed ``| transport |``)."""
    lines = (ROOT / "docs" / "weight-sync.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| transport |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def row_cells(s: TransportSpec) -> list[str]:
    """What the docs' table must say of ``s``, column by column."""
    yes = {True: "yes", False: "no"}
    return [f"`{s.name}`", s.summary, s.memory, s.hosts, s.reach, yes[s.cuda], s.carrier,
            f"`{s.engine_backend}`" if s.engine_backend else "none (rlpipe's stager)", yes[s.adapters],
            yes[s.sharded_engines], "never" if s.auto is None else str(s.auto + 1), yes[s.choosable],
            f"`{s.module.replace('.', '/')}.py`"]


def test_the_docs_table_is_the_table():
    expected = [row_cells(s) for s in SPECS.values()]
    assert doc_table() == expected, "docs/weight-sync.md's transport table should read:\n" + "\n".join(
        "| " + " | ".join(cells) + " |" for cells in expected)
    for s in SPECS.values():  # the module each row names exists
        assert (ROOT / f"{s.module.replace('.', '/')}.py").is_file(), s.module


def test_the_config_accepts_the_tables_names_and_describes_them_from_it():
    field = SyncConfig.model_fields["transport"]
    assert typing.get_args(field.annotation) == transports.CHOICES == ("auto", *TRANSPORTS)
    assert field.description == transports.describe() and all(name in field.description for name in TRANSPORTS)


def _strings(node: ast.AST) -> list[str]:
    return [e.value for e in getattr(node, "elts", []) if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def test_no_other_product_file_lists_or_branches_on_transport_names():
    """A list of two or more transport names, or a comparison with one, outside the table is
    a rule that does not read the row: the next transport would have to be added there too."""
    names = set(TRANSPORTS)
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "rlpipe" / "transports.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                listed = len(names & set(_strings(node))) >= 2
                compared = isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators])
                if listed or compared:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


@pytest.fixture
def new_row(monkeypatch):
    """A transport that is one row: auto's first choice, CUDA, every worker, adapters, sharded
    engines, implemented by an existing module (the rules must not care which)."""
    row = replace(SPECS["nccl"], name="fabric", reach="any", adapters=True, auto=-1, engine_backend="fabric")
    monkeypatch.setitem(SPECS, "fabric", row)
    return row


def test_a_new_row_is_honoured_by_every_rule(new_row):
    from rollout_service.engine_args import engine_args_problems
    from weight_sync.device_plane import plane
    from weight_sync.transport_choice import broadcast_for, resolve_transport, transfer_backend

    assert resolve_transport("auto", 8, placement=(0, [(0,), (1,)])) == "fabric"  # reaches a mixed fleet
    assert resolve_transport("auto", 8, adapters=True) == "fabric"
    assert resolve_transport("auto", 0) == "gloo"
    with pytest.raises(ValueError, match=r"fabric moves weights between CUDA devices .* \(use auto or gloo\)"):
        resolve_transport("fabric", 0)
    with pytest.raises(ValueError, match="nccl cannot reach worker 0, .* use fabric, ipc or gloo"):
        resolve_transport("nccl", 1, placement=(0, [(0,)]))
    assert engine_args_problems({"tensor_parallel_size": 2}, "fabric") == []
    assert "sync.transport nccl (CUDA) or fabric (CUDA)" in engine_args_problems({"tensor_parallel_size": 2})[0]
    assert transfer_backend("fabric") == "fabric" and plane("fabric").__name__ == new_row.module
    assert broadcast_for("fabric", 2048, 5).transport == "nccl"  # the module's own class


def test_a_named_transport_is_refused_by_its_row_not_its_name():
    from weight_sync.transport_choice import resolve_transport

    with pytest.raises(ValueError, match=r"sync.transport: 'udp' is not one of auto, gloo, nccl, ipc"):
        resolve_transport("udp", 8)
    with pytest.raises(ValueError, match="sync.transport: ipc cannot reach worker 1, which is not on GPU 0 with "
                                         r"learner rank 0 \(CUDA IPC shares memory on one GPU\); use nccl or gloo"):
        resolve_transport("ipc", 2, placement=(0, [(0,), (1,)]))
    with pytest.raises(ValueError, match="nccl loads whole versions .* travels over gloo .* use auto or gloo"):
        resolve_transport("nccl", 2, adapters=True)
