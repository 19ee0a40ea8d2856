"""The product's packages stand on floors (issue 34), and every import points down or sideways:

- floor 0, the core: ``rlpipe`` (config, queue, schema, registry, ...);
- floor 1: ``quant`` and ``weight_sync`` (quant imports weight_sync, never the reverse);
- floor 2, the roles: ``learner`` and ``rollout_service``, which never import each other;
- floor 3, the roof: ``launch`` (the CLI and everything that starts a run) and ``bench``.

Every import statement counts, those inside functions too (a hidden upward import is still
one), read with ``ast`` from the sources, so nothing is imported here. A failure names each
offending ``file:line``.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"rlpipe": 0, "quant": 1, "weight_sync": 1, "learner": 2, "rollout_service": 2, "launch": 3, "bench": 3}
APART = ({"learner", "rollout_service"},)  # packages on one floor that must not import each other at all


def imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(importing package, imported package, ``file:line module``) for every import between two
    different product packages under ``root``."""
    found = []
    for package in FLOORS:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:  # relative: its own package
                    modules = [node.module or ""]
                else:
                    continue
                for module in modules:
                    target = module.split(".")[0]
                    if target in FLOORS and target != package:
                        found.append((package, target, f"{path.relative_to(root)}:{node.lineno} {module}"))
    return found


def upward(root: Path = ROOT) -> list[str]:
    return [f"{where} (floor {FLOORS[src]} {src} -> floor {FLOORS[dst]} {dst})"
            for src, dst, where in imports(root) if FLOORS[dst] > FLOORS[src]]


def circles(root: Path = ROOT) -> list[str]:
    """Every import on an arrow that closes a circle between packages (an arrow a -> b where
    b also reaches a)."""
    edges = defaultdict(list)
    for src, dst, where in imports(root):
        edges[(src, dst)].append(where)
    graph = defaultdict(set)
    for src, dst in edges:
        graph[src].add(dst)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return False

    return [f"{where} ({src} -> {dst}, and {dst} reaches {src})"
            for (src, dst), wheres in sorted(edges.items()) if reaches(dst, src) for where in wheres]


def between_apart(root: Path = ROOT) -> list[str]:
    return [f"{where} ({src} -> {dst})" for src, dst, where in imports(root) if {src, dst} in APART]


def test_every_product_package_has_a_floor():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    packaged = {name.rstrip("*") for name in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packaged | {"bench"} == set(FLOORS)
    assert all((ROOT / package).is_dir() for package in FLOORS)


def test_no_import_points_up():
    bad = upward()
    assert not bad, "imports from a lower floor to a higher one:\n" + "\n".join(bad)


def test_no_import_circle_between_packages():
    bad = circles()
    assert not bad, "imports that close a circle between packages:\n" + "\n".join(bad)


def test_the_roles_do_not_import_each_other():
    bad = between_apart()
    assert not bad, "imports between learner and rollout_service:\n" + "\n".join(bad)


def test_the_check_sees_imports_inside_functions(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    for package in FLOORS:
        (tmp_path / package).mkdir()
    (tmp_path / "rlpipe" / "core.py").write_text("import os\n\n\ndef f():\n    from learner.train import x\n")
    (tmp_path / "quant" / "a.py").write_text("from weight_sync import names\n")
    (tmp_path / "weight_sync" / "b.py").write_text("import quant.transfer\nfrom . import c\n")
    assert upward(tmp_path) == ["rlpipe/core.py:5 learner.train (floor 0 rlpipe -> floor 2 learner)"]
    assert circles(tmp_path) == ["quant/a.py:1 weight_sync (quant -> weight_sync, and weight_sync reaches quant)",
                                 "weight_sync/b.py:1 quant.transfer (weight_sync -> quant, and quant reaches weight_sync)"]
