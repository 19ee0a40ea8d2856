"""The shipped alert rules and dashboard (deploy/k8s/base/monitoring), checked offline.

- ``promtool check rules`` accepts the PrometheusRule's spec, and ``promtool test rules`` runs
  tests/promtool/alerts_test.yaml against it: every alert fires on its condition, with its
  labels and rendered annotations, and the tricky ones stay quiet where they must (a finished
  learner is not stalled, a learner that disappeared is).
- Every alert has ``for``, a severity, a summary, a description and a runbook link to a heading
  of docs/operations.md, and at least one promtool case.
- The dashboard's datasource is a template variable and every rate() uses ``$__rate_interval``;
  its ``run`` variable lists the runs' ``run_id`` and every metric of every query is filtered on it.
- The held-out panels query the series the learner exports for an evaluation, by the labels it sets
  (the live run of tests/test_ops_live.py trains the toy task, which has no held-out set).

tests/test_ops_live.py evaluates the same expressions against a real Prometheus scraping a live run.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import yaml

from tests.ops_tools import DASHBOARD, ROOT, alert_rules, alerts, dashboard, dashboard_queries, tool, write_rules_file

PROMTOOL_TEST = ROOT / "tests" / "promtool" / "alerts_test.yaml"
RUNBOOK = ROOT / "docs" / "operations.md"
RUNBOOK_URL = "https://github.com/rlpipe/rlpipe/blob/main/docs/operations.md#"
RANGE_FUNCTIONS = ("rate", "irate", "increase")


def promtool(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_check_rules_accepts_the_prometheusrule(tmp_path):
    rules = write_rules_file(tmp_path)
    out = promtool("check", "rules", str(rules), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in alert_rules()['groups'])} rules found" in out.stdout


def test_promtool_unit_tests_fire_every_alert(tmp_path):
    write_rules_file(tmp_path)  # rules.yml, the name the test file loads
    shutil.copy(PROMTOOL_TEST, tmp_path / PROMTOOL_TEST.name)
    out = promtool("test", "rules", PROMTOOL_TEST.name, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_rules_file_is_a_prometheusrule_the_operator_selects():
    doc = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / "monitoring" / "prometheusrule.yaml").read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["name"] == "rlpipe-alerts"
    assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "rlpipe"
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert all(name.startswith("Rlpipe") for name in names)


def test_every_alert_has_for_severity_and_annotations():
    for rule in alerts():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))) and not re.fullmatch(r"0+[smh]", rule["for"]), \
            f"{name}: for"
        assert rule.get("labels", {}).get("severity") in ("critical", "warning"), f"{name}: severity"
        annotations = rule.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            assert annotations.get(key, "").strip(), f"{name}: annotation {key}"
        assert annotations["runbook_url"] == RUNBOOK_URL + name.lower(), f"{name}: runbook_url"


def github_anchor(heading: str) -> str:
    """GitHub's slug of a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_every_runbook_link_names_a_heading_of_operations_md():
    text = RUNBOOK.read_text()
    anchors = {github_anchor(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}
    for rule in alerts():
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in anchors, f"{rule['alert']}: no heading for #{anchor} in docs/operations.md"
        assert re.search(rf"^### {rule['alert']}\s*$", text, flags=re.M), rule["alert"]


def test_every_alert_has_a_promtool_case_where_it_fires():
    cases = yaml.safe_load(PROMTOOL_TEST.read_text())
    firing, tested = set(), set()
    for case in cases["tests"]:
        for check in case.get("alert_rule_test", []):
            tested.add(check["alertname"])
            if check.get("exp_alerts"):
                firing.add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert not names - firing, f"alerts never shown firing in {PROMTOOL_TEST.name}: {sorted(names - firing)}"
    assert not tested - names, f"cases for alerts that do not exist: {sorted(tested - names)}"


def test_dashboard_datasource_is_templated_and_rates_use_rate_interval():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    queries = dashboard_queries()
    assert len(queries) >= 20
    problems = []
    for title, expr in queries:
        for func, window in re.findall(rf"\b({'|'.join(RANGE_FUNCTIONS)})\s*\((.*?)\)", expr):
            if "[$__rate_interval]" not in window:
                problems.append(f"{title}: {func}() without [$__rate_interval]: {expr}")
    assert not problems, "\n".join(problems)

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for panel in panels(board["panels"]):
        if panel.get("type") == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], panel["title"]
    assert DASHBOARD.read_text().count("${datasource}") >= len(queries)


def test_dashboard_covers_the_pipeline():
    titles = " | ".join(title.lower() for title, _ in dashboard_queries())
    exprs = " ".join(expr for _, expr in dashboard_queries())
    for word in ("reward", "response length", "mismatch", "truncat", "staleness", "step time", "tokens/s",
                 "queue", "weight sync", "quant", "restart", "held-out"):
        assert word in titles, word
    for metric in ("rlpipe_mismatch_k3_kl_by_precision", "rlpipe_mismatch_kl_by_precision",
                   "rlpipe_is_truncated_fraction", "rlpipe_learner_wait_seconds", "rlpipe_learner_train_seconds",
                   "rlpipe_rollout_tokens_total", "rlpipe_queue_depth", "rlpipe_queue_pending",
                   "rlpipe_weight_sync_seconds_bucket", "rlpipe_weight_sync_bytes_total",
                   "rlpipe_quant_saturation_fraction", "process_start_time_seconds", "rlpipe_eval_accuracy",
                   "rlpipe_eval_version"):
        assert metric in exprs, metric


def test_no_kl_is_drawn_as_a_percentage():
    """A KL is nats, not a fraction: in a panel whose unit is a percentage, a KL query has its own unit."""
    from tests.ops_tools import _panels

    wrong = []
    for panel in _panels(dashboard().get("panels", [])):
        if "percent" not in panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""):
            continue
        own_unit = {o["matcher"]["options"] for o in panel["fieldConfig"].get("overrides", [])
                    if o["matcher"]["id"] == "byFrameRefID" and any(p["id"] == "unit" for p in o["properties"])}
        wrong += [f"{panel['title']}: {t['expr']}" for t in panel.get("targets", [])
                  if re.search(r"_kl(_|\b)", t.get("expr", "")) and t["refId"] not in own_unit]
    assert not wrong, wrong


def test_every_dashboard_query_is_filtered_by_the_run_variable():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["run"]["type"] == "query"
    assert variables["run"]["query"]["query"] == "label_values(rlpipe_learner_step, run_id)"
    assert variables["run"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    problems = []
    for title, expr in dashboard_queries():
        selectors = re.findall(r"\b((?:rlpipe|process)_[a-z0-9_]+|up)\b(?!\s*\()(\{[^}]*\})?", expr)
        assert selectors, f"{title}: no metric in {expr}"
        problems += [f"{title}: {name}{labels} in {expr}" for name, labels in selectors
                     if 'run_id="$run"' not in labels]
    assert not problems, "series not filtered by run:\n" + "\n".join(problems)


def test_the_held_out_panels_query_what_the_learner_exports():
    from prometheus_client import generate_latest

    from learner.metrics import LearnerMetrics

    metrics = LearnerMetrics(None, run_name="r1")
    metrics.record_eval(10, {"dataset": "svamp", "pass_at_1": 0.25, "mean_at_k": 0.5, "k": 4, "version": 9, "step": 10})
    page = generate_latest(metrics.registry).decode()
    exported = dict(re.findall(r"^(rlpipe_eval_\w+\{[^}]*\}) (\S+)$", page, re.M))
    queried = {name for _, expr in dashboard_queries() for name in re.findall(r"\brlpipe_eval_\w+", expr)}
    assert queried == {"rlpipe_eval_accuracy", "rlpipe_eval_version"}
    assert {k.split("{")[0] for k in exported} == queried, page
    # the accuracy panel's legend and grouping name these labels
    (expr,) = [e for _, e in dashboard_queries() if "rlpipe_eval_accuracy" in e]
    assert "by (dataset, metric)" in expr
    assert exported == {'rlpipe_eval_accuracy{dataset="svamp",metric="pass@1",run_id="r1"}': "0.25",
                        'rlpipe_eval_accuracy{dataset="svamp",metric="mean@4",run_id="r1"}': "0.5",
                        'rlpipe_eval_version{run_id="r1"}': "9.0"}, page


def test_the_sync_phases_panel_queries_what_the_learner_exports():
    """Prepare, transfer, pause and convergence: gauges of the learner's rows (learner/metrics.py),
    the last two once a version converged (weight_sync/convergence.py)."""
    from prometheus_client import generate_latest

    from learner.metrics import LearnerMetrics
    from weight_sync.convergence import Converged

    metrics = LearnerMetrics(None, run_name="r1")
    metrics.record({"weight_sync_prepare_seconds": 0.2, "weight_sync_transfer_seconds": 0.3,
                    "weight_sync_form_seconds": 0.0, **Converged(4, 0.9, 0.05, 2).metrics()})
    page = generate_latest(metrics.registry).decode()
    exprs = [e for title, e in dashboard_queries() if title.startswith("Weight sync phases")]
    queried = {name for e in exprs for name in re.findall(r"\brlpipe_\w+", e)}
    assert queried == {f"rlpipe_weight_sync_{p}_seconds" for p in ("prepare", "transfer", "pause_max", "convergence")}
    for name in queried:
        assert re.search(rf'^{name}{{run_id="r1"}} \S+$', page, re.M), name
    assert re.search(r'^rlpipe_weight_sync_pause_max_seconds\{run_id="r1"\} 0\.05$', page, re.M)
