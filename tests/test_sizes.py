"""The size bounds of the house: no class over 300 lines and no function over 80, in the product
and in bench/, so that a room holds one idea a reader can see whole (tests/ may run longer)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rlpipe", "launch", "learner", "rollout_service", "weight_sync", "quant", "bench", "scripts")
CLASS_LINES, FUNCTION_LINES = 300, 80


def oversized(root: Path = ROOT) -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.ClassDef) and lines > CLASS_LINES:
                    out.append(f"class {path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > FUNCTION_LINES:
                    out.append(f"function {path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    return out


def test_no_class_over_300_lines_and_no_function_over_80():
    assert oversized() == []


def test_the_bound_sees_a_long_class_and_a_long_function(tmp_path):
    (tmp_path / "bench").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(CLASS_LINES))
    steps = "\n".join(f"    y = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "bench" / "big.py").write_text(f"class Big:\n{body}\n\n\ndef long():\n{steps}\n")
    assert [line.split(" ")[0:2] for line in oversized(tmp_path)] == [["class", "bench/big.py:1"],
                                                                     ["function", "bench/big.py:304"]]
