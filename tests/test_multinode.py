"""A learner over two "nodes": two `rlpipe learner` processes on this machine, each its
own torchrun agent (learner.nodes 2, learner.node_rank 0/1), meeting over loopback at
learner.rendezvous (torchrun's static rendezvous, launch/launcher.py torchrun_command).

They must train what one process trains (to float tolerance, as tests/test_ddp.py's ranks
on one machine do). A node that dies must stop the job, not hang it, and the restarted
nodes resume from the last checkpoint and finish with the weights one process reaches.
On GPUs the same command runs over NCCL between machines; that part is torch's and is not
run here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from safetensors.torch import load_file

from launch.launcher import kill_group
from learner import checkpoint
from learner.policy import load_policy
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import connect
from tests.conftest import ROOT
from tests.test_ddp import prepared_run
from tests.test_learner import for_run, synthetic_groups

LEARNER = [sys.executable, "-m", "launch.cli", "learner", "--config"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(run_dir, port: int, log_dir, node1: dict | None = None, cwd=(None, None)) -> list[subprocess.Popen]:
    """Node 1 first: it waits at the rendezvous for node 0, whose ranks come first anyway.
    ``node1``: node 1's own environment on top; ``cwd``: each node's working directory."""
    procs = []
    for node in (1, 0):
        env = {**ENV, "RLPIPE_LEARNER__NODE_RANK": str(node), "RLPIPE_LEARNER__RENDEZVOUS": f"127.0.0.1:{port}",
               "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [ENV.get("PYTHONPATH")])]),  # any cwd
               **((node1 or {}) if node else {})}
        log = open(log_dir / f"node{node}.log", "a")
        procs.append(subprocess.Popen([*LEARNER, str(run_dir / "config.yaml")], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      cwd=cwd[node]))
    return procs[::-1]  # [node 0, node 1]


def latest_step(run_dir) -> int:
    return int(checkpoint.latest(run_dir / "checkpoints").name.removeprefix("step_"))


def weights(run_dir) -> dict:
    return load_file(checkpoint.latest(run_dir / "checkpoints") / "model.safetensors")


def difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_node_other_than_0_serves_healthz_while_node_0s_store_answers():
    """learner/node_health.py, as main.py starts it on node 1's first rank: 200 while node 0's
    rendezvous store (a stand-in listener here) accepts connections, 503 once it is gone."""
    from learner.node_health import serve_node_health

    store = socket.create_server(("127.0.0.1", 0))
    address = serve_node_health("127.0.0.1", 0, f"127.0.0.1:{store.getsockname()[1]}", node_rank=1)
    assert get(f"http://{address}/healthz") == (200, {"status": "ok", "node_rank": 1})
    assert get(f"http://{address}/metrics")[0] == 404  # rank 0's state lives on node 0 only
    store.close()
    code, body = get(f"http://{address}/healthz")
    assert code == 503 and body["node_rank"] == 1 and "does not answer" in body["status"]


def lose_node_1_and_restart(nodes: list, cfg, later_groups, run_dir, restart, log) -> None:
    """Node 1 is lost (its agent and its rank, in a session of their own, SIGKILLed) after step 2's
    checkpoint; the next step's groups arrive, and node 0 must then fail, not hang. ``nodes`` becomes
    the restarted nodes (``restart()``), which meet again, resume from step 2 and finish."""
    kill_group(nodes[1], signal.SIGKILL)
    nodes[1].wait()
    queue = TrajectoryQueue(connect(cfg.redis_url), cfg.run_id)
    for rec in for_run(later_groups, cfg):
        queue.push(rec)
    t0 = time.monotonic()
    code = nodes[0].wait(timeout=120)
    print(f"node 0 stopped {time.monotonic() - t0:.1f}s after the groups came, exit code {code}")
    assert code != 0
    assert latest_step(run_dir) == 2
    nodes[:] = restart()
    for p in nodes:
        assert p.wait(timeout=300) == 0, log.read_text()[-3000:]


# A soak test: the FSDP test below covers the same loss and restart (and more) in the suite's budget;
# this one keeps DDP's path, about 4 minutes on a loaded 2-core machine
@pytest.mark.slow
@pytest.mark.soak
def test_two_nodes_train_as_one_process_and_a_lost_node_stops_the_job_which_resumes(
        redis_server, toy_model_path, tmp_path):
    groups = synthetic_groups(load_policy(toy_model_path), 16, seed=5, noise=0.1)
    common = {"steps": 4, "learner.checkpoint_every": 2, "queue.max_staleness": 100}
    single, single_dir = prepared_run(tmp_path, "single", redis_server, toy_model_path, groups, **common)
    subprocess.run([*LEARNER, str(single_dir / "config.yaml")], check=True, env=ENV, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = load_policy(toy_model_path).state_dict()
    moved = difference(weights(single_dir), base)
    assert moved > 1e-3, "the steps did not train"

    # Two nodes with only the first 2 steps' groups: they train them, checkpoint, and wait.
    cfg, run_dir = prepared_run(tmp_path, "nodes", redis_server, toy_model_path, groups[:8], **common,
                                **{"learner.nodes": 2, "learner.parallel": "ddp",
                                   "learner.rendezvous": "127.0.0.1:1"})  # each node is given its own below
    port = free_port()
    nodes = start_nodes(run_dir, port, tmp_path)
    try:
        deadline = time.monotonic() + 240
        while checkpoint.latest(run_dir / "checkpoints") is None:
            assert time.monotonic() < deadline, (tmp_path / "node0.log").read_text()[-3000:]
            assert all(p.poll() is None for p in nodes), (tmp_path / "node0.log").read_text()[-3000:]
            time.sleep(0.5)
        lose_node_1_and_restart(nodes, cfg, groups[8:], run_dir, lambda: start_nodes(run_dir, free_port(), tmp_path),
                                tmp_path / "node0.log")
    finally:
        for p in nodes:
            if p.poll() is None:
                kill_group(p, signal.SIGKILL)
    assert latest_step(run_dir) == 4
    diff = difference(weights(run_dir), weights(single_dir))
    print(f"max weight change {moved:.3e}, two nodes with a restart vs one process {diff:.3e}")
    assert diff < 1e-2 * moved


def adam(run_dir) -> dict:
    """The newest checkpoint's Adam state, by parameter name (the full format: gathered whole)."""
    return checkpoint.load_state(checkpoint.latest(run_dir / "checkpoints"))["optimizer"]["state"]


@pytest.mark.slow
def test_only_node_0_reads_checkpoints_and_a_restart_resumes_every_rank_alike(redis_server, toy_model_path, tmp_path):
    """Across nodes (checkpoint_format auto = full) only node 0 reads and writes checkpoints.
    learner.checkpoint_dir is relative, and node 1 runs in an empty directory: rank 0's
    checkpoint paths name nothing there. Node 1 serves /healthz while the nodes train. After
    node 1 is lost, the restarted nodes resume from node 0's checkpoint, rank 1 with the weights,
    Adam state and step rank 0 sent it: under FSDP each rank trains its own shard, so the
    final weights and Adam moments are one process's after 4 steps only if rank 1's were
    restored too."""
    groups = synthetic_groups(load_policy(toy_model_path), 16, seed=5, noise=0.1)
    common = {"steps": 4, "learner.checkpoint_every": 2, "queue.max_staleness": 100, "learner.parallel": "fsdp"}
    _, single_dir = prepared_run(tmp_path, "single", redis_server, toy_model_path, groups, **common)
    subprocess.run([*LEARNER, str(single_dir / "config.yaml")], check=True, env=ENV, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg, run_dir = prepared_run(tmp_path, "nodes", redis_server, toy_model_path, groups[:8], **common,
                                **{"learner.nodes": 2, "learner.rendezvous": "127.0.0.1:1",
                                   "learner.checkpoint_dir": "checkpoints"})  # node 0's cwd: run_dir
    elsewhere = tmp_path / "node1"  # node 1's working directory: no checkpoints/ there
    elsewhere.mkdir()
    health = free_port()
    node1 = {"RLPIPE_LEARNER__PORT": str(health)}
    nodes = []
    try:
        nodes = start_nodes(run_dir, free_port(), tmp_path, node1, (run_dir, elsewhere))
        deadline = time.monotonic() + 240
        while checkpoint.latest(run_dir / "checkpoints") is None:
            assert time.monotonic() < deadline, (tmp_path / "node1.log").read_text()[-3000:]
            assert all(p.poll() is None for p in nodes), (tmp_path / "node1.log").read_text()[-3000:]
            time.sleep(0.5)
        assert get(f"http://127.0.0.1:{health}/healthz") == (200, {"status": "ok", "node_rank": 1})
        lose_node_1_and_restart(nodes, cfg, groups[8:], run_dir,
                                lambda: start_nodes(run_dir, free_port(), tmp_path, node1, (run_dir, elsewhere)),
                                tmp_path / "node1.log")
    finally:
        for p in nodes:
            if p.poll() is None:
                kill_group(p, signal.SIGKILL)
    assert not list(elsewhere.iterdir()), "node 1 wrote into its working directory"
    assert "resumed from step_00000002: step 2" in (tmp_path / "node1.log").read_text()
    assert latest_step(run_dir) == 4
    moved = difference(weights(single_dir), load_policy(toy_model_path).state_dict())
    diff = difference(weights(run_dir), weights(single_dir))
    print(f"max weight change {moved:.3e}, two nodes resumed vs one process {diff:.3e}")
    assert moved > 1e-3 and diff < 1e-2 * moved
    ours, single = adam(run_dir), adam(single_dir)
    for moment in ("exp_avg", "exp_avg_sq"):
        scale = max(s[moment].abs().max().item() for s in single.values())
        gap = max((ours[n][moment] - s[moment]).abs().max().item() for n, s in single.items())
        print(f"{moment}: largest {scale:.3e}, two nodes vs one process {gap:.3e}")
        assert gap < 1e-2 * scale, moment
    assert {float(s["step"]) for s in ours.values()} == {float(s["step"]) for s in single.values()}
