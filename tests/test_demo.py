"""The whole loop, as a user runs it: ``rlpipe demo`` with Redis, 2 workers and the learner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from launch.cluster import audit
from launch.demo import run_demo
from launch.redis_server import EmbeddedRedis
from learner import checkpoint
from learner.metrics import read_jsonl
from rlpipe.config import build_config, load_config
from rlpipe.keys import Keys
from rlpipe.redis_link import connect
from rlpipe.registry import learner_state, live_workers
from tests.conftest import interruptible, wait_for

pytestmark = pytest.mark.slow


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.status()} ppid {p.ppid()}: {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            pass
    return out


def processes_of_run(launcher_pid: int, run_dir: Path) -> list[psutil.Process]:
    """Every process a run started: roles (and their engines) carry the launcher's pid in
    their environment; the embedded Redis runs in the run directory (it rewrites its title)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid == launcher_pid:
                continue
            if p.environ().get("RLPIPE_PARENT_PID") == str(launcher_pid) or p.cwd().startswith(str(run_dir)):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.mark.soak
def test_demo_learns_versions_advance_and_nothing_is_lost(tmp_path):
    steps = 30
    cfg = build_config({}, environ={}, steps=steps, seed=0, run_id="e2e")
    summary = run_demo(cfg, runs_dir=str(tmp_path), progress=False)
    run_dir = tmp_path / "e2e"
    rows = read_jsonl(run_dir / "metrics.jsonl")

    assert summary["completed"] and len(rows) == steps
    assert [r["learner_version"] for r in rows] == list(range(1, steps + 1))
    # Every version reached both workers, and what they sampled followed the versions.
    assert all(r["weight_sync_members"] == 2 and "weight_sync_failed" not in r for r in rows)
    assert all(r["staleness_max"] <= cfg.queue.staleness_bound for r in rows)
    assert rows[-1]["staleness_mean"] <= cfg.queue.max_lag + 1

    # No group lost: every one produced was trained, dropped, or is still in the stream.
    produced, trained = summary["groups_produced"], summary["groups_trained"]
    assert produced == trained + summary["groups_dropped_stale"] + summary["groups_filtered"] + summary["groups_pending"]
    assert trained == steps * cfg.learner.groups_per_step
    assert summary["groups_dead"] == 0
    # The final checkpoint holds every step, so nothing is left unacknowledged. (The last
    # row's checkpoint_step is the last one durable when the step ended: with async
    # checkpoints the final write finishes after that row.)
    final = checkpoint.latest(run_dir / "checkpoints")
    assert summary["groups_unacknowledged"] == 0 and final.name == f"{checkpoint.PREFIX}{steps:08d}"
    assert checkpoint.read_meta(final)["trained_groups"] == trained

    # It learns: the reward's least-squares slope over the run is positive, beyond its own
    # noise (t > 2). The first and last 5 steps' means, compared before, each carry about
    # 0.015 of noise against a rise of about 0.05 over 30 steps: a run that learned
    # (0.26 -> 0.31, slope t = 2.9) failed their 0.05 margin.
    rewards = [r["reward_mean"] for r in rows]
    slope, t = reward_trend(rewards)
    assert slope > 0 and t > 2, (slope, t, rewards)

    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "summary.json").exists() and (run_dir / "logs" / "learner.log").exists()
    assert processes_of_run(os.getpid(), run_dir) == []


def reward_trend(values: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``values`` per step and its t statistic (slope / standard error)."""
    n = len(values)
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    sxx = sum((x - x_mean) ** 2 for x in range(n))
    slope = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(values)) / sxx
    residual = sum((y - y_mean - slope * (x - x_mean)) ** 2 for x, y in enumerate(values))
    return slope, slope / ((residual / (n - 2)) ** 0.5 / sxx ** 0.5)


def check_http_interfaces(run_dir: Path, worker_ids: list[str]) -> None:
    """The running learner and workers answer on their published addresses."""
    cfg = load_config(run_dir / "config.yaml", environ={})
    r = connect(cfg.redis_url)
    keys = Keys(cfg.run_id)
    learner = httpx.Client(base_url=f"http://{learner_state(r, keys)['address']}", timeout=30)
    status = learner.get("/status").json()
    assert status["status"] == "running" and status["version"] >= 1 and status["last_metrics"]["reward_mean"] >= 0
    assert sorted(status["sync_members"]) == worker_ids
    assert status["lr_schedule"]["kind"] == cfg.learner.schedule.kind and status["checkpoint"]["every"] >= 1
    metrics = learner.get("/metrics").text
    for name in ("rlpipe_learner_step", "rlpipe_reward_mean", "rlpipe_mismatch_kl", "rlpipe_is_weight_mean",
                 "rlpipe_staleness_versions_bucket", "rlpipe_dropped_stale_total", "rlpipe_queue_dead_total",
                 "rlpipe_weight_sync_seconds_bucket", "rlpipe_weight_sync_bytes_total",
                 "rlpipe_mismatch_log_ppl_abs_diff", 'rlpipe_mismatch_kl_by_precision{precision="bf16",run_id=',
                 "rlpipe_is_ess", "rlpipe_learner_grad_norm_smoothed", "rlpipe_lr_schedule_lr"):
        assert name in metrics, name
    workers = live_workers(r, keys)
    assert sorted(workers) == worker_ids
    for w in workers.values():
        text = httpx.get(f"http://{w['address']}/metrics", timeout=30).text
        for name in ("rlpipe_rollout_tokens_total", "rlpipe_rollout_groups_total", "rlpipe_rollout_generate_seconds",
                     "rlpipe_rollout_policy_version", "rlpipe_rollout_paused_seconds_total",
                     "rlpipe_weight_sync_pause_seconds"):
            assert name in text, name
        assert httpx.get(f"http://{w['address']}/readyz", timeout=30).status_code == 200


def test_max_lag_0_trains_only_groups_the_current_weights_sampled_under_dynamic_sampling(tmp_path):
    """``queue.max_lag: 0`` is synchronous RL with dynamic sampling too: at 2 answers a prompt about half
    the groups carry no signal and are filtered, the fleet samples more per version to make up for them,
    and every trained group was sampled by the weights it trains (one late, dropped and counted, never
    trained). The 30-step demo above holds max_lag 1 the same way."""
    cfg = build_config({}, environ={}, steps=6, seed=0, run_id="sync", **{
        "queue.max_lag": 0, "sampling.n": 2, "learner.groups_per_step": 8})
    summary = run_demo(cfg, runs_dir=str(tmp_path), progress=False)
    rows = read_jsonl(tmp_path / "sync" / "metrics.jsonl")
    print({k: summary[k] for k in ("groups_produced", "groups_trained", "groups_filtered", "groups_dropped_stale")},
          [(r["staleness_max"], r["dropped_stale_step"], r["groups_filtered_step"]) for r in rows])
    assert summary["completed"] and len(rows) == 6
    assert all(r["staleness_max"] == 0 for r in rows)
    assert summary["groups_filtered"] >= 0.3 * summary["groups_produced"]  # most of the fleet's work filtered
    assert summary["groups_produced"] == (summary["groups_trained"] + summary["groups_dropped_stale"]
                                          + summary["groups_filtered"] + summary["groups_pending"])


# bf16 rollout, no correction and a bf16 learner: the demo's default engine, and the options' own tests
# (test_loss, test_learner) cover the rest: a soak test
@pytest.mark.parametrize("precision,is_mode,dtype", [("fp8", "seq_mis", "fp32"),
                                                     pytest.param("bf16", "bypass", "bf16", marks=pytest.mark.soak)])
def test_short_demo_runs_and_stamps_its_records(tmp_path, precision, is_mode, dtype):
    cfg = build_config({}, environ={}, steps=3, run_id=precision, workers=1, **{
        "rollout.precision": precision, "learner.groups_per_step": 16, "learner.is_mode": is_mode,
        "learner.dtype": dtype})  # one worker: two engines test nothing more here, and cost a start each
    summary = run_demo(cfg, runs_dir=str(tmp_path), progress=False)
    rows = read_jsonl(tmp_path / precision / "metrics.jsonl")
    assert summary["completed"] and [r["learner_version"] for r in rows] == [1, 2, 3]
    assert all(r["groups_by_precision"] == {precision: 16} for r in rows)
    assert set(rows[0]["mismatch_by_precision"]) == {precision} and summary["groups_unacknowledged"] == 0
    assert all(r["weight_sync_members"] == 1 for r in rows)
    # The rollout precision is a different function from the learner's, but a close one.
    assert 0 < rows[0]["mismatch_k3_kl"] < 0.05


# soak: a whole mixed demo; tests/test_mixed_fleet.py holds a mixed fleet's promise in the suite
@pytest.mark.soak
def test_a_mixed_int8_bf16_fleet_runs_and_reports_each_precision(tmp_path):
    """``rlpipe demo --precision int8,bf16``: the launcher calibrates an int8 profile, one
    worker runs int8 (from the profile's checkpoint, updated with the learner's int8
    tensors), the other bf16, each on its own sync channel."""
    from launch.cli import main as rlpipe_main
    from quant.quant_profile import QuantProfile

    code = rlpipe_main(["demo", "--precision", "int8,bf16", "--steps", "5", "--run-id", "mixed", "--runs-dir",
                        str(tmp_path), "--set", "learner.groups_per_step=16", "--set", "quant.int8.calibration_samples=48",
                        "--set", "quant.int8.probe_samples=16"])
    assert code == 0
    run_dir = tmp_path / "mixed"
    cfg = load_config(run_dir / "config.yaml", environ={})
    profile = QuantProfile.load(cfg.quant.int8.profile)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["precision"] == "int8,bf16" and len(rows) == 5
    assert summary["groups[int8]"] > 0 and summary["groups[bf16]"] > 0
    assert summary["groups_trained"] == summary["groups[int8]"] + summary["groups[bf16]"]
    assert rows[-1]["trained_groups_by_precision_total"] == {"int8": summary["groups[int8]"],
                                                            "bf16": summary["groups[bf16]"]}
    assert all(summary[f"staleness_mean[{p}]"] >= 0 for p in ("int8", "bf16"))
    # every version reached both workers, each on its channel, with the int8 profile's tensors
    assert all(r["weight_sync_members"] == 2 and set(r["weight_sync_by_precision"]) == {"int8", "bf16"} for r in rows)
    assert all(r["quant_profile"] == profile.hash for r in rows)
    # the monitors run beside the updates (quant/background.py): each result comes with a later step's row
    monitored = [r for r in rows if "quant_kl_vs_bf16" in r]
    assert monitored and all(r["quant_kl_vs_bf16"] < 0.05 and r["quant_monitor_step"] < r["step"] for r in monitored)
    int8_rows = [r for r in rows if "int8" in r["mismatch_by_precision"]]
    # k3, not k1: k1 (mean log-ratio) is unbiased but can dip below zero on one small step
    assert int8_rows and all(0 < r["mismatch_by_precision"]["int8"]["mismatch_k3_kl"] < 1 for r in int8_rows)
    assert all(0 <= r["reward_by_precision"]["int8"] <= 1 for r in int8_rows)
    assert summary["quant_recalibrations_total"] == 0
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the last checkpoint carries the int8 tensors a returning worker catches up on
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert json.loads((last / "rollout" / "int8" / "quant.json").read_text())["quant_profile"] == profile.hash


# SIGKILL is a soak case (the same cleanup path as Ctrl-C, minutes on CI)
@pytest.mark.parametrize("how", [signal.SIGINT, pytest.param(signal.SIGKILL, marks=pytest.mark.soak)],
                         ids=["ctrl-c", "sigkill"])
def test_stopping_the_demo_leaves_no_process_behind(tmp_path, how):
    """The signal goes to the demo's whole process group, as a terminal's Ctrl-C does. A
    Ctrl-C finishes the step in hand and checkpoints it, then stops the workers and Redis
    last, and prints the summary: the books kept in Redis's append-only file balance."""
    run_dir = tmp_path / "stop"
    log = open(tmp_path / "demo.log", "wb")
    demo = subprocess.Popen([sys.executable, "-m", "launch.cli", "demo", "--steps", "500", "--workers", "1",
                             "--run-id", "stop", "--runs-dir", str(tmp_path)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=interruptible)
    try:
        wait_for(lambda: demo.poll() is not None or len(read_jsonl(run_dir / "metrics.jsonl")) >= 1, 300,
                 interval=0.5, what="the first learner step")
        assert demo.poll() is None, (tmp_path / "demo.log").read_text()[-3000:]
        assert len(processes_of_run(demo.pid, run_dir)) >= 4  # redis, the worker's server + engine, learner
        if how == signal.SIGINT:
            check_http_interfaces(run_dir, ["w0"])
        os.killpg(demo.pid, how)
        demo.wait(150)  # the learner may take up to launcher.LEARNER_GRACE_S
        # A Ctrl-C stops children in order; a killed launcher's children notice and stop themselves.
        try:
            wait_for(lambda: not processes_of_run(demo.pid, run_dir), 45, interval=0.5, what="every child to exit")
        except TimeoutError as e:  # name the survivors: which role, in which state
            raise AssertionError(f"{e}: {describe(processes_of_run(demo.pid, run_dir))}") from None
    finally:
        if demo.poll() is None:
            demo.kill()
        for p in processes_of_run(demo.pid, run_dir):
            p.kill()
        log.close()
    assert not processes_of_run(demo.pid, run_dir)
    if how == signal.SIGINT:
        out = (tmp_path / "demo.log").read_text()
        assert demo.returncode == 130 and "Traceback" not in out, out[-3000:]
        assert "rlpipe demo summary" in out and json.loads((run_dir / "summary.json").read_text())["interrupted"]
        assert "Traceback" not in (run_dir / "logs" / "learner.log").read_text()
        # the last step trained is checkpointed, and nothing acknowledged was lost
        rows = read_jsonl(run_dir / "metrics.jsonl")
        final = checkpoint.latest(run_dir / "checkpoints")
        assert final.name == f"{checkpoint.PREFIX}{rows[-1]['step']:08d}", (final, len(rows))
        with EmbeddedRedis(run_dir / "redis") as redis_again:  # the run's Redis, from its append-only file
            books = audit(connect(redis_again.url), load_config(run_dir / "config.yaml", environ={}), ["w0"])
        assert books["lost"] == 0 and books["trained_twice"] == 0 and books["trained_groups"] > 0, books


def test_the_summary_of_a_run_whose_redis_is_gone_leaves_the_books_out_and_keeps_the_rest(tmp_path, capsys):
    """_summarize's fallback when Redis cannot be reached (an external one, down): the queue's
    counts are None, and the rest is still summarized (it raised KeyError on ``filtered``)."""
    import socket

    from launch.demo import _summarize

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = build_config({}, environ={}, run_id="gone", run_dir=str(tmp_path), redis_url=f"redis://127.0.0.1:{port}/0")
    summary = _summarize(cfg, tmp_path, t_start=0.0, learner_done=False)
    assert summary["groups_filtered"] is None and summary["groups_produced"] is None and summary["steps"] == 0
    assert "Redis is unreachable" in capsys.readouterr().err


def test_a_stopped_demo_run_again_under_its_run_id_resumes_from_its_last_checkpoint(tmp_path):
    """The documented resume (docs/quickstart.md, "Resuming a run"): `rlpipe demo --steps 3 --run-id again`,
    then `--steps 6` under the same run id and run directory, continues
    from the last checkpoint (the learner's steps, its books and its Redis state, kept in the run
    directory) instead of starting over; here a 3-step run is taken on to 6."""
    def config(steps):  # as the command line builds it, each time
        return build_config({}, environ={}, steps=steps, seed=0, run_id="again",
                            **{"learner.checkpoint_every": 3, "learner.groups_per_step": 8})

    first = run_demo(config(3), runs_dir=str(tmp_path), progress=False)
    assert first["completed"] and first["final_version"] == 3
    second = run_demo(config(6), runs_dir=str(tmp_path), progress=False)
    rows = read_jsonl(tmp_path / "again" / "metrics.jsonl")
    assert second["completed"] and [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], [r["step"] for r in rows]
    assert second["groups_trained"] == 6 * 8 and second["groups_dead"] == 0
