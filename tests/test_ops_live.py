"""Operations against a live run: a real Prometheus server scrapes ``rlpipe up`` (the roles
the Kubernetes manifests run, as separate supervised processes) with the alert rules of
deploy/k8s loaded, and the local operations act on it.

- every dashboard query returns data and every alert expression evaluates, and a metric
  name that no target exports fails;
- two planted faults, a killed worker and a stopped learner, show their alerts going
  pending and then firing (the rules' ``for`` is shortened to 2 s here, their expressions
  are the shipped ones);
- ``rlpipe restart learner`` and ``rlpipe scale rollout`` 2 -> 1 during the run: no group is
  lost or trained twice, the versions converge, and the pipeline is back at its steady
  state (staleness within ``max_lag``, no drops) after the last change. (A worker added to
  a live ``up`` joining the sync and the books is tests/test_autoscale_live.py's.)

One run serves every test of this module, in order.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from launch.cluster import audit, segments, steady
from launch.redis_server import free_port
from launch.up import STATE_FILE, write_prometheus_config
from learner.metrics import read_jsonl
from rlpipe import registry
from rlpipe.config import build_config, dump_config
from rlpipe.keys import Keys
from rlpipe.redis_link import connect
from tests.conftest import ROOT, free_run_id, wait_for
from tests.ops_tools import alert_rules, dashboard_queries, tool

pytestmark = pytest.mark.slow
SHORT_FOR = "2s"
METRIC_NAME = re.compile(r"\b((?:rlpipe|process)_[a-z0-9_]+|up)\b(?!\s*\()")
# Exported only by a run with eval.every set; this toy-task run has no held-out set, so their queries must evaluate
# but need not exist or hold data (test_alert_rules.py checks them against what the learner exports).
ONLY_WITH_EVAL = "rlpipe_eval_"
ONLY_WITH_MOE = ("rlpipe_routing_", "rlpipe_router_")  # only a mixture-of-experts run (routing_: with replay)


class Live:
    def __init__(self, work: Path, cfg, up: subprocess.Popen, prom_url: str, r):
        self.work, self.cfg, self.up, self.prom, self.r = work, cfg, up, prom_url, r
        self.run_dir = Path(cfg.run_dir)
        self.keys = Keys(cfg.run_id)

    def query(self, expr: str) -> dict:
        return httpx.get(f"{self.prom}/api/v1/query", params={"query": expr}, timeout=10).json()

    def values(self, expr: str) -> list[float]:
        out = self.query(expr)
        assert out["status"] == "success", (expr, out)
        return [float(s["value"][1]) for s in out["data"]["result"]]

    def alerts(self) -> list[dict]:
        return httpx.get(f"{self.prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]

    def roles(self) -> dict:
        return json.loads((self.run_dir / STATE_FILE).read_text())["roles"]

    def cli(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "launch.cli", *args, "--run-dir", str(self.run_dir)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def learner_step(self) -> int:
        return int(registry.learner_state(self.r, self.keys).get("step", 0))

    def wait_healthy(self, min_step: int = 4, timeout: float = 600):
        """Wait until both workers and the learner are scraped, the learner has trained ``min_step``
        steps, the int8 monitors are exported and no outage alert is active: the state each test
        starts from. (On a loaded 2-core machine the learner's first step can take minutes; an
        alert test that started before it would see the learner already 'stalled'.)"""
        outage = {"RlpipeLearnerStalled", "RlpipeRolloutWorkerDown", "RlpipeNoWorkersReady"}
        wait_for(lambda: self.values('sum(up{job="rlpipe-rollout"})') == [2.0]
                 and self.values('up{job="rlpipe-learner"}') == [1.0]
                 and (self.values("rlpipe_learner_step") or [0])[0] >= min_step
                 and self.values("rlpipe_quant_saturation_fraction")
                 and not outage & {a["labels"]["alertname"] for a in self.alerts()}, timeout,
                 interval=1, what=f"a healthy scraped run with {min_step} steps; up log:\n{self.log()[-3000:]}")

    def wait_alert(self, name: str, timeout: float = 90, **labels) -> set[str]:
        """Poll the alerts until ``name`` (with ``labels``) has been seen pending and then firing."""
        seen: list[str] = []

        def fired():
            for a in self.alerts():
                if a["labels"].get("alertname") == name and all(a["labels"].get(k) == v for k, v in labels.items()):
                    if not seen or seen[-1] != a["state"]:
                        seen.append(a["state"])
            return "firing" in seen

        wait_for(fired, timeout, interval=0.25, what=f"alert {name} {labels} firing (seen: {seen}); "
                 f"up log:\n{self.log()[-3000:]}")
        return seen

    def log(self) -> str:
        return (self.work / "up.log").read_text(errors="replace")


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def live(tmp_path_factory, toy_model_path, redis_server):
    prometheus = tool("prometheus")
    work = tmp_path_factory.mktemp("ops-live")
    run_id = free_run_id("up")
    base = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg = build_config(base, environ={}, run_id=run_id, steps=100000, workers=2, **{
        "model.path": toy_model_path, "rollout.fleet": ["int8", "bf16"], "learner.groups_per_step": 16,
        "learner.checkpoint_every": 5, "rollout.shutdown_deadline_s": 5.0,
        # the exact back-pressure bound (staleness <= max_lag) is pinned below: dynamic sampling makes it
        # a bound in expectation (config reference, learner.dynamic_sampling), so it is off here
        "learner.dynamic_sampling": False})
    cfg_path = work / "run.yaml"
    dump_config(cfg, cfg_path)
    env = {**os.environ, "REDIS_URL": redis_server.url}  # Redis outlives `up`, for the audit
    with open(work / "up.log", "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "launch.cli", "up", "--config", str(cfg_path),
                               "--runs-dir", str(work / "runs")], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT, start_new_session=True)
    run_dir = work / "runs" / run_id
    prom = None
    try:
        wait_for(lambda: (run_dir / "config.yaml").exists() or up.poll() is not None, 600, what="up started")
        assert up.poll() is None, (work / "up.log").read_text()
        spec = alert_rules()
        for group in spec["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    rule["for"] = SHORT_FOR
        rules = work / "rules-short-for.yml"
        rules.write_text(yaml.safe_dump(spec))
        prom_cfg = write_prometheus_config(run_dir, "1s", [str(rules)], name="prometheus-test.yml")
        port = free_port()
        prom = subprocess.Popen([prometheus, f"--config.file={prom_cfg}", f"--storage.tsdb.path={work / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=open(work / "prometheus.log", "wb"),
                                stderr=subprocess.STDOUT)
        wait_for(lambda: prom.poll() is not None or _ready(f"http://127.0.0.1:{port}"), 120, interval=0.5,
                 what="prometheus ready")
        assert prom.poll() is None, (work / "prometheus.log").read_text()[-3000:]
        from rlpipe.config import load_config

        yield Live(work, load_config(run_dir / "config.yaml"), up, f"http://127.0.0.1:{port}",
                   connect(redis_server.url))
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            try:
                up.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()


def test_every_dashboard_query_and_alert_expression_evaluates_against_the_live_run(live):
    # The whole fleet up and scraped, a few steps trained, quantization monitors exported.
    live.wait_healthy()
    time.sleep(5)  # a few more scrapes for the rate() windows
    exported = set(httpx.get(f"{live.prom}/api/v1/label/__name__/values", timeout=10).json()["data"])
    alert_exprs = [(r["alert"], r["expr"]) for g in alert_rules()["groups"] for r in g["rules"] if "alert" in r]
    queries = dashboard_queries()
    assert queries and alert_exprs
    problems = []
    for where, expr, must_have_data in [*((w, e, True) for w, e in queries), *((w, e, False) for w, e in alert_exprs)]:
        expr = expr.replace("$__rate_interval", "1m").replace("$run", live.cfg.run_id)  # the dashboard's variables
        missing = {m for m in METRIC_NAME.findall(expr) if m.removesuffix("_bucket") not in exported
                   and m not in exported and m not in ("up",)}
        # a name only valid as a label or function would not be ours; metric names must exist
        missing = {m for m in missing if not re.search(rf"{m}\s*=", expr)}
        if ONLY_WITH_EVAL in expr or any(m in expr for m in ONLY_WITH_MOE):
            missing, must_have_data = set(), False
        if missing:
            problems.append(f"{where}: no such metric {sorted(missing)} in {expr}")
            continue
        out = live.query(expr)
        if out.get("status") != "success":
            problems.append(f"{where}: {out.get('error')} in {expr}")
        elif must_have_data and not out["data"]["result"]:
            problems.append(f"{where}: no data for {expr}")
    assert not problems, "\n".join(problems)
    # Every series of the roles carries the run (the dashboard's run variable lists it).
    unlabelled = live.values(f'count({{__name__=~"(rlpipe|process)_.+", run_id!="{live.cfg.run_id}"}})')
    assert unlabelled in ([], [0.0]), unlabelled
    assert live.values(f'count(rlpipe_learner_step{{run_id="{live.cfg.run_id}"}})') == [1.0]
    # Every rule group loaded and evaluated without error.
    groups = httpx.get(f"{live.prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    assert len([x for x in rules if x["type"] == "alerting"]) == len(alert_exprs)
    wait_for(lambda: all(x.get("health") == "ok" for x in
                         [rule for g in httpx.get(f"{live.prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
                          for rule in g["rules"]]), 30, interval=1, what="every rule evaluated without error")
    # and a healthy run raises none of the outage alerts
    firing = {a["labels"]["alertname"] for a in live.alerts()}
    assert not firing & {"RlpipeLearnerStalled", "RlpipeRolloutWorkerDown", "RlpipeNoWorkersReady"}, firing


def test_a_killed_worker_fires_its_alert_and_comes_back(live):
    live.wait_healthy()
    victim = live.roles()["w1"]
    os.kill(victim["pid"], signal.SIGKILL)
    seen = live.wait_alert("RlpipeRolloutWorkerDown", instance="w1")
    assert seen[:2] == ["pending", "firing"], seen
    # the supervisor restarts it, it catches up and is ready again
    wait_for(lambda: live.roles()["w1"]["restarts"] == 1 and live.values('rlpipe_rollout_ready{worker="w1"}') == [1.0],
             300, interval=1, what="w1 restarted and ready")


def test_a_stopped_learner_fires_the_stalled_alert(live):
    live.wait_healthy()
    live.cli("scale", "learner", "0")
    try:
        seen = live.wait_alert("RlpipeLearnerStalled")
    finally:  # the next test needs a learner, whatever happened here
        step = live.learner_step()
        live.cli("scale", "learner", "1")
    assert seen[:2] == ["pending", "firing"], seen
    wait_for(lambda: live.learner_step() >= step + 2, 300, interval=1, what="the learner training again")


def test_restart_learner_and_scale_workers_2_1_lose_nothing_and_converge(live):
    live.wait_healthy()
    r, keys, max_lag = live.r, live.keys, live.cfg.queue.max_lag

    def converged(worker_ids):
        workers = registry.live_workers(r, keys)
        version = registry.learner_version(r, keys)
        return all(int(workers.get(w, {}).get("version", -1)) >= version - 1 for w in worker_ids)

    restarts = live.roles()["learner"]["restarts"]
    step = live.learner_step()
    live.cli("restart", "learner")
    wait_for(lambda: live.roles()["learner"]["restarts"] == restarts + 1 and live.learner_step() >= step + 3, 300,
             interval=1, what="the learner restarted and training")
    live.cli("scale", "rollout", "1")
    wait_for(lambda: live.roles()["w1"]["state"] == "stopped", 120, interval=1, what="w1 stopped")
    step = live.learner_step()
    wait_for(lambda: live.learner_step() >= step + 8, 300, interval=1, what="8 steps with one worker")
    wait_for(lambda: converged(["w0"]), 60, interval=0.5, what="w0 on the learner's version")
    status = live.cli("status")
    assert "w0" in status and "queue:" in status, status
    # Stop the whole run as an operator would (SIGTERM to `up`: workers drain, the learner checkpoints).
    os.killpg(live.up.pid, signal.SIGTERM)
    assert live.up.wait(180) in (0, 130), live.log()[-3000:]
    books = audit(r, live.cfg, ["w0", "w1"])
    assert books["lost"] == 0 and books["trained_twice"] == 0, books
    # Back at the steady state: the last steps with one worker train nothing beyond max_lag, drop nothing.
    rows = segments(read_jsonl(live.run_dir / "metrics.jsonl"))[-1]
    tail = steady(rows[-5:])
    assert tail["staleness_max"] <= max_lag and tail["drop_rate"] == 0, tail
