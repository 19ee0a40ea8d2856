"""A run deployed as a deployment runs it, for the fault runs (tests/test_restarts.py,
tests/test_chaos.py and the others, and bench/faults.py through launch/chaos.py): its own
``redis-server`` (AOF everysec, so it can be SIGKILLed and restarted on the same port and
directory), N ``rlpipe rollout`` processes and one ``rlpipe learner`` process, each started,
killed and restarted by the caller as an operator (or a supervisor) would.

:meth:`Cluster.audit` checks the books at the end, from what Redis and the final
checkpoint hold; :func:`segments` and :func:`steady` read the learner's metrics to tell
whether the pipeline came back to its steady state after a fault, not only whether it
lost nothing. Also here: how a worker process is started and stopped (:func:`launch_worker`,
:func:`stop_worker`, which the tests' fixtures use too) and :func:`wait_for`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import yaml

from launch.redis_server import EmbeddedRedis
from learner import checkpoint
from rlpipe import registry
from rlpipe.config import build_config, dump_config
from rlpipe.index_set import IndexSet
from rlpipe.keys import Keys
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import PASSWORD_FILE_ENV, connect

ROOT = Path(__file__).resolve().parent.parent
# The fault runs' settings (tests/test_restarts.py, launch/chaos.py), and how many steps after a
# restart a run has to be steady again ("within a few steps").
SETTINGS = {"steps": 27, "learner.groups_per_step": 8, "learner.checkpoint_every": 3, "learner.lease_ttl_s": 30.0,
            "learner.threads": 1, "queue.max_lag": 1, "queue.max_staleness": 4, "rollout.heartbeat_ttl_s": 4.0,
            "rollout.heartbeat_s": 1.0, "rollout.max_inflight_groups": 8,
            "learner.dynamic_sampling": False}  # the exact bound staleness <= max_lag is pinned: see test_ops_live
SETTLE = 4  # steps after a restart before it must be steady again


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def free_run_id(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"


def launch_worker(cfg, cfg_path: Path, worker_id: str, env: dict | None = None, wait: bool = True,
                  args: tuple[str, ...] = ()):
    """Start worker ``worker_id`` of the run in ``cfg_path`` (log: <run_dir>/<id>.log, or
    worker.log for w0), with ``rlpipe rollout``'s further ``args``; returns (process,
    address), the address once it registered."""
    run_dir = Path(cfg.run_dir)
    log_path = run_dir / ("worker.log" if worker_id == "w0" else f"{worker_id}.log")
    address_file = run_dir / f"address-{worker_id}"
    address_file.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "rollout", "--config", str(cfg_path),
                                 "--worker-id", worker_id, "--address-file", str(address_file), *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    r = connect(cfg.redis_url)

    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {log_path.read_text()[-3000:]}")
        return address_file.exists() and r.exists(Keys(cfg.run_id).worker(worker_id))

    if wait:
        wait_for(up, 300, interval=0.5, what="rollout worker start-up")
    return proc, address_file.read_text() if wait else None


def stop_worker(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()


class Cluster:
    def __init__(self, tmp_path: Path, model_path: str, workers: int = 2, password: str | None = None,
                 password_in_url: bool = False, **settings):
        self.dir = tmp_path
        self.redis = EmbeddedRedis(tmp_path / "redis", password=password).start()
        url = self.redis.url.replace("redis://", f"redis://:{password}@") if password and password_in_url \
            else self.redis.url
        # Otherwise every process (this one's clients too) reads it from a file, as from a
        # mounted secret; stop() unsets it.
        self.password_file = None
        if password and not password_in_url:
            self.password_file = tmp_path / "redis-password"
            self.password_file.write_text(password + "\n")
            os.environ[PASSWORD_FILE_ENV] = str(self.password_file)
        base = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
        self.cfg = build_config(base, environ={}, run_id=free_run_id("cluster"), run_dir=str(tmp_path),
                                redis_url=url, workers=workers, **{
                                    "model.path": model_path,
                                    # the fault tests pin back-pressure's exact bound (staleness <= max_lag),
                                    # which dynamic sampling makes a bound in expectation: off unless asked
                                    "learner.dynamic_sampling": False, **settings})
        self.cfg_path = tmp_path / "config.yaml"
        dump_config(self.cfg, self.cfg_path)
        self.keys = Keys(self.cfg.run_id)
        self.workers: dict[str, subprocess.Popen] = {}
        self.learner: subprocess.Popen | None = None
        self.faults: list[str] = []
        self.fault_rows: list[int] = []
        self._aof_sizes: list[tuple[float, int]] = []
        self._stopped = threading.Event()
        threading.Thread(target=self._watch_aof, daemon=True).start()

    def client(self):
        return connect(self.cfg.redis_url, wait_s=60)

    # -- roles -------------------------------------------------------------------------
    def start_worker(self, worker_id: str, wait: bool = True, env: dict | None = None, args: tuple[str, ...] = ()) -> None:
        env = {"RLPIPE_CPU_AFFINITY": str(int(worker_id.lstrip("w") or 0) % os.cpu_count()), **(env or {})}
        self.workers[worker_id], _ = launch_worker(self.cfg, self.cfg_path, worker_id, env=env, wait=wait, args=args)

    def start_learner(self) -> None:
        log = open(self.dir / "learner.log", "a")
        log.write(f"\n=== learner start {time.strftime('%X')} ===\n")
        log.flush()
        self.learner = subprocess.Popen([sys.executable, "-m", "launch.cli", "learner", "--config", str(self.cfg_path)],
                                        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def _fault(self, what: str) -> None:
        """Note a fault, and how many learner steps (metrics rows) were done before it."""
        path = self.dir / "metrics.jsonl"
        rows = len(path.read_text().splitlines()) if path.exists() else 0
        self.faults.append(what)
        self.fault_rows.append(rows)

    def kill_learner(self) -> None:
        self._fault(f"SIGKILL learner at step {self.step()}")
        os.killpg(self.learner.pid, signal.SIGKILL)
        self.learner.wait()

    def kill_learner_rank(self, rank: int) -> None:
        """SIGKILL one rank of a learner running under torchrun (``learner.ranks`` > 1), alone."""
        self._fault(f"SIGKILL learner rank {rank} at step {self.step()}")
        os.kill(learner_rank_pid(self.learner.pid, rank), signal.SIGKILL)

    def kill_worker(self, worker_id: str) -> None:
        self._fault(f"SIGKILL worker {worker_id} at step {self.step()}")
        os.killpg(self.workers[worker_id].pid, signal.SIGKILL)
        self.workers[worker_id].wait()

    def kill_redis(self, down_s: float = 3.0, lose_s: float = 1.0) -> None:
        """SIGKILL redis-server and start it again ``down_s`` later, on the same port and
        directory. A SIGKILLed Redis loses nothing its AOF already wrote (the page cache
        keeps it); a machine that dies loses up to a second with ``appendfsync everysec``,
        so the AOF is cut back to its length ``lose_s`` before the kill, as that would."""
        aof, step = self.redis.data_dir / "appendonly.aof", self.step()
        self._aof_sizes.append((time.monotonic(), aof.stat().st_size))
        cut = max((size for t, size in self._aof_sizes if t <= time.monotonic() - lose_s), default=None)
        self.redis.kill()
        if lose_s and cut is not None:
            lost = aof.stat().st_size - cut
            os.truncate(aof, cut)
        else:
            lost = 0
        self._fault(f"SIGKILL redis-server at step {step}, back after {down_s:g}s, "
                    f"its last {lose_s:g}s of AOF ({lost} bytes) lost")
        time.sleep(down_s)
        self.redis.start()

    def inject(self, plan: list[tuple[int, str]], log=lambda message: None) -> None:
        """At each ``(step, kind)`` of ``plan``, as a supervisor would see it: SIGKILL the
        learner and start it again, SIGKILL worker w1 and start it again under the same
        id, or SIGKILL redis-server and bring it back (see :meth:`kill_redis`)."""
        for step, kind in plan:
            self.wait_step(step)
            log(f"step {step}: {kind}")
            if kind == "learner":
                self.kill_learner()
                self.start_learner()
            elif kind == "worker":
                self.kill_worker("w1")
                self.start_worker("w1", wait=False)
            elif kind == "poison":
                self.inject_poison()
            else:
                self.kill_redis(down_s=3.0)

    def inject_poison(self) -> None:
        """What a worker with a bug, a stray tool or an operator could put in: well-formed
        records that do not fit the run (a 2,048-token one among them, which OOM-killed the
        learner on every restart before records were checked), raw XADDs never counted as
        produced, and the loss of the sync hash (a restore, a key cleaned by hand)."""
        import numpy as np

        from rlpipe.example_record import make_record
        from rlpipe.schema import Sample, encode_group

        r = self.client()
        q = TrajectoryQueue(r, self.cfg.run_id)
        n, long = self.cfg.sampling.n, np.full(2048, 5, dtype=np.int32)

        def samples(tokens):
            return [Sample(tokens, np.full(len(tokens), -0.5, dtype=np.float32), "stop", float(i % 2))
                    for i in range(n)]

        fit = dict(run_id=self.cfg.run_id, precision=self.cfg.rollout.precision, policy_version=0,
                   policy_version_end=0, samples=samples(np.array([5, 2], dtype=np.int32)))
        forged = [{**fit, "samples": samples(long)}, {**fit, "policy_version": 10**6, "policy_version_end": 10**6},
                  {**fit, "run_id": "another-run"}, {**fit, "samples": samples(np.array([10**6, 2], dtype=np.int32))},
                  {**fit, "samples": fit["samples"][:1]}, {**fit, "prompt_index": 2**62, "attempt": 999}]
        for i, fields in enumerate(forged):
            q.push(make_record(**{**fields, "group_id": f"forged-{i}"}))
        r.xadd(q.keys.traj, {"data": encode_group(make_record(**{**fit, "group_id": "raw"}))})
        r.delete(q.keys.sync)

    def _watch_aof(self) -> None:
        """Note the AOF's length every 50 ms (for kill_redis's lost second)."""
        aof = self.redis.data_dir / "appendonly.aof"
        while not self._stopped.wait(0.05):
            try:
                self._aof_sizes.append((time.monotonic(), aof.stat().st_size))
            except OSError:
                pass
            del self._aof_sizes[:-200]

    def step(self) -> int:
        """The learner's step as it published it (0 while Redis is away)."""
        try:
            return int(registry.learner_state(connect(self.cfg.redis_url), self.keys).get("step", 0))
        except Exception:
            return 0

    def wait_step(self, step: int, timeout: float = 600) -> None:
        def reached():
            self.check_alive()
            return self.step() >= step
        wait_for(reached, timeout, interval=0.5, what=f"learner step {step}")

    def wait_done(self, timeout: float = 900) -> None:
        def done():
            self.check_alive(learner_may_exit=True)
            return self.learner.poll() is not None
        wait_for(done, timeout, interval=0.5, what="the learner to finish")
        assert self.learner.returncode == 0, self.log("learner")

    def check_alive(self, learner_may_exit: bool = False) -> None:
        for w, proc in self.workers.items():
            assert proc.poll() is None, f"worker {w} exited: {self.log(w)}"
        if not learner_may_exit:
            assert self.learner.poll() is None, f"learner exited: {self.log('learner')}"

    def log(self, role: str, tail: int | None = 4000) -> str:
        path = self.dir / ("learner.log" if role == "learner" else "worker.log" if role == "w0" else f"{role}.log")
        text = path.read_text(errors="replace") if path.exists() else ""
        return text[-tail:] if tail else text

    def stop_roles(self) -> None:
        """Stop the workers as Kubernetes would (SIGTERM: they give back what is in flight)."""
        for proc in self.workers.values():
            if proc.poll() is None:
                stop_worker(proc)
        if self.learner is not None and self.learner.poll() is None:
            os.killpg(self.learner.pid, signal.SIGKILL)
            self.learner.wait()

    def stop(self) -> None:
        self._stopped.set()
        self.stop_roles()
        self.redis.stop()
        if self.password_file is not None:
            os.environ.pop(PASSWORD_FILE_ENV, None)

    # -- what the test checks -----------------------------------------------------------
    def metrics(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def audit(self) -> dict:
        return audit(self.client(), self.cfg, list(self.workers))


@contextlib.contextmanager
def audited(cluster: Cluster) -> Iterator[dict]:
    """Run a test's block against ``cluster``; yields the dict that, once the block ends
    without an error, holds the run's books: the roles stopped first (:meth:`Cluster.stop_roles`,
    so nothing is in flight or leased), then :meth:`Cluster.audit`. Whatever happens, the
    cluster is stopped at the end (its Redis too, and the password file's variable unset),
    so a failed test leaves no process behind."""
    books: dict = {}
    try:
        yield books
        cluster.stop_roles()
        books.update(cluster.audit())
    finally:
        cluster.stop()


def learner_rank_pid(root: int, rank: int) -> int:
    """The pid of learner rank ``rank`` among the descendants of ``root`` (torchrun's ranks
    carry RANK in their environment)."""
    children = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                children.setdefault(int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK" in b" ".join(env):
            return pid
        todo += children.get(pid, [])
    raise LookupError(f"no learner rank {rank} under pid {root}")


def audit(r, cfg, worker_ids) -> dict:
    """The books at the end (workers stopped, so nothing is in flight or leased):

    - produced == trained + dropped + dead + duplicate + what is left in the stream;
    - every prompt index below the cursor was trained by the final lineage or dropped,
      is still in the stream, was given back, or was skipped (and counted);
    - no prompt was trained twice in the final lineage (its trained count equals the
      number of distinct prompt indices it trained), and the ``trained`` counter equals
      that count.
    """
    q = TrajectoryQueue(r, cfg.run_id)
    c = q.counters()
    length = q.length()
    assert c["produced"] == c["trained"] + c["dropped_stale"] + c["dead"] + c["duplicate"] + c["filtered"] + length, (c, length)
    final = checkpoint.latest(Path(cfg.run_dir) / "checkpoints")
    state = checkpoint.load_state(final)
    trained = IndexSet(state["prompt_indices"]["trained"])
    dropped = q.dropped_indices()
    in_stream = {e.record.prompt_index for e in q._decode(r.xrange(Keys(cfg.run_id).traj))}
    returned = {int(i) for i in r.lrange(Keys(cfg.run_id).returned, 0, -1)}
    leased = set().union(*(q.leased(w) for w in worker_ids))
    cursor = int(r.get(Keys(cfg.run_id).cursor) or 0)
    accounted = set(trained) | set(dropped) | in_stream | returned | leased
    assert c["leased"] == len(leased), (c, leased)  # the fleet's in-flight count is its leases
    missing = set(range(cursor)) - accounted
    assert len(missing) == c["skipped"], (sorted(missing)[:20], c)
    trained_groups = state["counters"]["trained_groups"]
    assert trained_groups == len(trained), (trained_groups, len(trained))
    # and the books agree with it: every group it trained was counted as trained, once
    assert c["trained"] == trained_groups, (c, trained_groups)
    return {"counters": c, "stream": length, "cursor": cursor, "trained_groups": trained_groups,
            "lost": len(missing) - c["skipped"], "trained_twice": trained_groups - len(trained)}




def segments(rows: list[dict]) -> list[list[dict]]:
    """The learner's metrics rows split by process: each process's first row carries
    ``learner_start_to_first_step_seconds``."""
    out: list[list[dict]] = []
    for row in rows:
        if "learner_start_to_first_step_seconds" in row or not out:
            out.append([])
        out[-1].append(row)
    return out


def back_to_steady(before: dict, after: dict, max_lag: int) -> bool:
    """``after`` (a stretch after a fault) is as healthy as ``before`` (one before any):
    no group beyond ``max_lag`` versions (back-pressure is exact in the steady state),
    mean staleness within a quarter version, and no more drops."""
    return (after["staleness_max"] <= max(max_lag, before["staleness_max"])
            and after["staleness"] <= before["staleness"] + 0.25 and after["drop_rate"] <= before["drop_rate"])


def steady(rows: list[dict]) -> dict:
    """Staleness and drop rate over ``rows``: mean staleness of the groups trained, and
    dropped / (trained + dropped) groups."""
    groups = sum(r["groups"] for r in rows)
    dropped = sum(r["dropped_stale_step"] for r in rows)
    return {"steps": len(rows), "staleness": sum(r["staleness_mean"] * r["groups"] for r in rows) / max(1, groups),
            "staleness_max": max((r["staleness_max"] for r in rows), default=0),
            "drop_rate": dropped / max(1, groups + dropped)}
