"""Helpers for the operations tests: the external tools (promtool, prometheus, kubectl), the
alert rules of the shipped PrometheusRule and the queries of the shipped Grafana dashboard.

``tool(name)`` looks in the directory of ``sys.executable`` first (``scripts/install.sh`` puts
promtool and prometheus into the venv's ``bin``), then on PATH. A missing tool skips the test,
or fails it when ``RLPIPE_REQUIRE_OPS_TOOLS=1`` (CI, where a skip would hide a broken install).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "deploy" / "k8s" / "base" / "monitoring"
RULES = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "dashboard.json"


def tool(name: str) -> str:
    """The path of the binary ``name``: next to this Python interpreter, else on PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    why = f"{name} not found next to {sys.executable} nor on PATH; scripts/install.sh installs it"
    if os.environ.get("RLPIPE_REQUIRE_OPS_TOOLS") == "1":
        pytest.fail(why + " (RLPIPE_REQUIRE_OPS_TOOLS=1)")
    pytest.skip(why)


def alert_rules(path: str | Path = RULES) -> dict:
    """The ``spec`` of the PrometheusRule at ``path``: a plain Prometheus rules file (``groups``)."""
    doc = yaml.safe_load(Path(path).read_text())
    assert doc["kind"] == "PrometheusRule", f"{path}: not a PrometheusRule"
    return doc["spec"]


def alerts(path: str | Path = RULES) -> list[dict]:
    """Every alerting rule of the PrometheusRule, in file order."""
    return [rule for group in alert_rules(path)["groups"] for rule in group["rules"] if "alert" in rule]


def write_rules_file(directory: str | Path, path: str | Path = RULES, name: str = "rules.yml") -> Path:
    """Write the PrometheusRule's spec as a plain rules file into ``directory``; returns its path."""
    out = Path(directory) / name
    out.write_text(yaml.safe_dump(alert_rules(path), sort_keys=False))
    return out


def dashboard(path: str | Path = DASHBOARD) -> dict:
    return json.loads(Path(path).read_text())


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows hold their collapsed panels


def dashboard_queries(path: str | Path = DASHBOARD) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every query target of every panel of the dashboard."""
    return [(panel.get("title", ""), target["expr"])
            for panel in _panels(dashboard(path).get("panels", []))
            for target in panel.get("targets", []) if target.get("expr")]


def check_metrics(text: str) -> None:
    """``promtool check metrics`` on a ``/metrics`` page: naming and type conventions (a
    counter ends in ``_total``, a gauge does not, HELP is present) must hold with no finding."""
    out = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and not out.stdout.strip(), f"promtool check metrics:\n{out.stdout}{out.stderr}"


def samples_without(text: str, label: str, value: str) -> list[str]:
    """The sample lines of a ``/metrics`` page that do not carry ``label="value"``."""
    return [line for line in text.splitlines()
            if line and not line.startswith("#") and not re.search(rf'[{{,]{label}="{re.escape(value)}"', line)]
