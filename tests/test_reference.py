"""The manual against the code: the two generated reference pages are current (as
tests/test_config.py keeps configs/demo.yaml current), every config key has a description,
the site builds with ``mkdocs build --strict`` (a broken link or anchor fails), no page names a
path that exists on one machine only, and the README stays a front door. A few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.ops_tools import check_metrics, tool

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
gen = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gen)
# A path from one machine: a home or work directory, as a run directory a reader cannot have.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|Users)/")


def test_the_reference_pages_are_current():
    assert not gen.stale(), "docs/reference/ is stale: run python scripts/gen_reference.py"


def test_every_config_key_has_a_description_and_a_row():
    assert not gen.undescribed()
    keys = gen.every_key()
    assert len(keys) >= 170 and {"learner.lr", "learner.eps_low", "queue.max_lag", "queue.max_staleness",
                                 "sampling.top_p", "learner.schedule.kind", "quant.fp8.quantize_on"} <= set(keys)
    page = gen.CONFIG_PAGE.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([\w]+)` \|", page, flags=re.M)
    assert len(rows) == len(keys)
    assert "`worker` \\| `learner`" in page  # quant.fp8's two variants, merged


def test_a_key_without_a_description_fails_generation(monkeypatch):
    from rlpipe.config import LearnerConfig

    monkeypatch.setattr(LearnerConfig.model_fields["lr"], "description", None)
    assert gen.undescribed() == ["learner.lr"]
    with pytest.raises(ValueError, match="learner.lr"):
        gen.config_page()


def test_check_names_a_stale_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "config.md"
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "PAGES", {page: gen.config_page})
    assert gen.main(["--check"]) == 1  # missing
    page.write_text(gen.config_page().replace("AdamW's peak learning rate", "the learning rate"))
    assert gen.main(["--check"]) == 1 and "config.md is stale" in capsys.readouterr().err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


def test_the_metrics_reference_lists_every_role_metric():
    from learner.metrics import METRICS, NOT_EXPORTED

    page = gen.METRICS_PAGE.read_text(encoding="utf-8")
    names = set(re.findall(r"^\| `(rlpipe_\w+)` \|", page, flags=re.M))
    # every metrics.jsonl key; a nested one (staleness_by_precision) as its values' gauges
    exported = {f"rlpipe_{k}" for k in METRICS if k not in NOT_EXPORTED | {"staleness_by_precision"}}
    exported |= {"rlpipe_staleness_mean_by_precision", "rlpipe_staleness_max_by_precision"}
    assert not exported - names, sorted(exported - names)
    assert {"rlpipe_rollout_tokens_total", "rlpipe_weight_sync_pause_seconds", "rlpipe_staleness_versions",
            "rlpipe_mismatch_kl_by_precision", "rlpipe_eval_accuracy", "rlpipe_learner_done"} <= names


def test_every_roles_exposition_passes_promtool_and_no_name_carries_a_labels_value():
    """promtool's metric lint on what the learner and a worker serve; a precision or a worker id is a label,
    never part of a name; each role says its build and what it runs; the rates have counters behind them."""
    from prometheus_client import generate_latest

    from rlpipe.precisions import SPECS
    from rollout_service.metrics import RolloutMetrics

    worker = RolloutMetrics("w0", "bf16", "reference", model="smollm2-135m-instruct").registry
    for registry in (gen.learner_registry(), worker):
        text = generate_latest(registry).decode()
        check_metrics(text)
        # quant_kl_vs_bf16 names its fixed reference (the int8 weights against bf16 ones), not one series of many
        names = {name for name, *_ in gen.families(registry)} - {"rlpipe_quant_kl_vs_bf16"}
        assert not [n for n in names for p in SPECS if re.search(rf"(^|_){p}(_|$)", n)], names
        assert "rlpipe_build_info" in names and 'role="' in text and 'vllm="' in text
    assert {"rlpipe_learner_steps_total", "rlpipe_learner_tokens_total",
            "rlpipe_learner_step_duration_seconds"} <= {n for n, *_ in gen.families(gen.learner_registry())}
    assert 'le="300.0"' in generate_latest(worker).decode()  # a real model's sync fits the buckets


def test_the_site_builds_strict(tmp_path):
    """mkdocs.yml at the root, every page in the nav, every link and anchor found."""
    out = subprocess.run([tool("mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_no_page_names_a_path_from_one_machine():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}" for p in pages
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not found, "\n".join(found)


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    head = "\n".join(text.splitlines()[:21])
    for command in ("./scripts/install.sh", ".venv/bin/rlpipe demo", ".venv/bin/python -m pytest -q"):
        assert command in head, command  # CI runs the README's install and test commands
    assert "rlpipe demo --config configs/smollm2-math.yaml" in text  # the real-model recipe
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 15 and not [link for link in links if not (ROOT / link).exists()]
