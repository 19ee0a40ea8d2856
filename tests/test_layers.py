"""The product's packages stand on floors (issue 34), and every import points down or sideways:

- floor 0, the core: ``rlpipe`` (config, keys, redis_link, queue, queue_scripts, schema, registry, ...);
- floor 1: ``quant`` and ``weight_sync`` (quant imports weight_sync, never the reverse);
- floor 2, the roles: ``learner`` and ``rollout_service``, which never import each other;
- floor 3, the roof: ``launch`` (the CLI and everything that starts a run) and ``bench``.

Inside ``bench`` no two files import each other, directly or round a longer circle
(bench/gpu.py and bench/gpu_check.py share their common pieces through bench/gpu_parts.py).

``bench`` and ``tests`` stand apart: no bench file imports anything of ``tests`` (``rlpipe bench``,
which CI runs, must not depend on test modules), and no test module imports ``bench`` but the
tests of the benches themselves (``tests/test_bench_*.py``). What both need lives in the product
(the toy's spec in launch/toy.py, the synthetic groups in learner/synthetic_groups.py, the fault
runs in launch/cluster.py and launch/chaos.py, the peak-memory probe in rlpipe/peak_memory.py).

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


def import_statements(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) for every absolute import statement in ``path``, those inside
    functions too: ``import a.b`` gives (line, "a.b", []), ``from a import b`` gives (line,
    "a", ["b"]) (``b`` may be a module of ``a``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:  # relative: its own package
            found.append((node.lineno, node.module or "", [alias.name for alias in node.names]))
    return found


def imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(importing package, imported package, ``file:line module``) for every import between two
    different product packages under ``root``."""
    found = []
    for package in FLOORS:
        for path in sorted((root / package).rglob("*.py")):
            for line, module, _ in import_statements(path):
                target = module.split(".")[0]
                if target in FLOORS and target != package:
                    found.append((package, target, f"{path.relative_to(root)}:{line} {module}"))
    return found


def file_imports(root: Path = ROOT, package: str = "bench") -> list[tuple[str, str, str]]:
    """(importing module, imported module, ``file:line module``) for every import between two
    different files of ``package`` under ``root`` (``from bench import gpu`` imports bench.gpu)."""
    own = {f"{package}.{path.stem}": path for path in sorted((root / package).glob("*.py"))}
    found = []
    for src, path in own.items():
        for line, module, names in import_statements(path):
            for target in {module, *(f"{module}.{name}" for name in names)} & own.keys() - {src}:
                found.append((src, target, f"{path.relative_to(root)}:{line} {module}"))
    return sorted(found)


def upward(root: Path = ROOT) -> list[str]:
    return [f"{where} (floor {FLOORS[src]} {src} -> floor {FLOORS[dst]} {dst})"
            for src, dst, where in imports(root) if FLOORS[dst] > FLOORS[src]]


def circles(root: Path = ROOT) -> list[str]:
    """Every import on an arrow that closes a circle between packages."""
    return closing(imports(root))


def bench_circles(root: Path = ROOT) -> list[str]:
    """Every import on an arrow that closes a circle between two files of ``bench``."""
    return closing(file_imports(root, "bench"))


def closing(arrows: list[tuple[str, str, str]]) -> list[str]:
    """Every import on an arrow that closes a circle (an arrow a -> b where b also reaches a),
    from (source, target, where) triples."""
    edges = defaultdict(list)
    for src, dst, where in arrows:
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


def bench_test_imports(root: Path = ROOT) -> list[str]:
    """Every import between ``bench`` and ``tests`` that is not allowed: of ``tests`` by a file
    of bench/, and of ``bench`` by a file of tests/ other than ``tests/test_bench_*.py``."""
    found = []
    for importer, imported in (("bench", "tests"), ("tests", "bench")):
        for path in sorted((root / importer).rglob("*.py")):
            if importer == "tests" and path.name.startswith("test_bench_"):
                continue
            for line, module, _ in import_statements(path):
                if module.split(".")[0] == imported:
                    found.append(f"{path.relative_to(root)}:{line} {module} ({importer} -> {imported})")
    return found


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


def test_no_import_circle_between_bench_files():
    bad = bench_circles()
    assert not bad, "imports that close a circle between files of bench/:\n" + "\n".join(bad)
    arrows = {(src, dst) for src, dst, _ in file_imports()}
    assert ("bench.gpu", "bench.gpu_check") in arrows and ("bench.gpu_check", "bench.gpu") not in arrows


def test_bench_and_tests_do_not_import_each_other():
    bad = bench_test_imports()
    assert not bad, ("imports between bench/ and tests/ (only tests/test_bench_*.py may import bench; "
                     "what both need belongs in the product):\n" + "\n".join(bad))


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


def test_the_bench_check_sees_a_circle_between_files(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.py").write_text("import os\n\n\ndef f():\n    from bench.b import x\n")
    (tmp_path / "bench" / "b.py").write_text("from bench import a\nfrom bench.c import y\n")
    (tmp_path / "bench" / "c.py").write_text("import bench.a as a\n")
    assert bench_circles(tmp_path) == ["bench/a.py:5 bench.b (bench.a -> bench.b, and bench.b reaches bench.a)",
                                       "bench/b.py:1 bench (bench.b -> bench.a, and bench.a reaches bench.b)",
                                       "bench/b.py:2 bench.c (bench.b -> bench.c, and bench.c reaches bench.b)",
                                       "bench/c.py:1 bench.a (bench.c -> bench.a, and bench.a reaches bench.c)"]
    (tmp_path / "bench" / "b.py").write_text("import bench.c\n")
    (tmp_path / "bench" / "c.py").write_text("import os\n")
    assert bench_circles(tmp_path) == []


def test_the_bench_and_tests_check_sees_both_directions(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "bench" / "a.py").write_text("import os\n\n\ndef f():\n    from tests.conftest import TOY_SPEC\n")
    (tmp_path / "bench" / "b.py").write_text("import tests.test_chaos\nfrom tests import conftest\nfrom bench import a\n")
    (tmp_path / "tests" / "conftest.py").write_text("from bench.synthetic import own_logprobs\n")
    (tmp_path / "tests" / "test_x.py").write_text("import bench.b\nimport benchmarks\n")
    (tmp_path / "tests" / "test_bench_b.py").write_text("from bench import b\n")  # a bench's own test: allowed
    assert bench_test_imports(tmp_path) == ["bench/a.py:5 tests.conftest (bench -> tests)",
                                            "bench/b.py:1 tests.test_chaos (bench -> tests)",
                                            "bench/b.py:2 tests (bench -> tests)",
                                            "tests/conftest.py:1 bench.synthetic (tests -> bench)",
                                            "tests/test_x.py:1 bench.b (tests -> bench)"]
