"""``rlpipe up``: the roles the Kubernetes manifests run (deploy/k8s), on one machine,
supervised the way Kubernetes would, and the commands that act on it.

    rlpipe up --config run.yaml        Redis (embedded unless REDIS_URL), the learner, N workers
    rlpipe status [--run-dir D]        roles, versions, lag, queue and sync, as a table
    rlpipe restart learner|rollout     graceful restart (SIGTERM, then start again)
    rlpipe scale rollout N             add or remove workers (highest ids go first)
    rlpipe scale learner 0|1           stop or start the learner (as scaling its StatefulSet)

The supervisor restarts a role that exits unasked with a growing back-off (1 s doubling
to 30 s, reset after a minute of running), as a kubelet does, saying why (the last line of
its log). Unlike a kubelet it gives up on a role that exits :data:`START_TRIES` times in a
row before it was ever ready (a learner that never published its state, a worker that
never answered ``/readyz``): ``up`` then stops, prints that role's last log lines and exits
1. A learner that exits 0 having trained every step ends the run (exit 0). Ctrl-C or
SIGTERM stops it in order (the learner first: it finishes its step and checkpoints; then
the workers; Redis last), prints the summary and exits 130. ``restart rollout`` restarts
the workers one at a time, each once the one before is ready again. While it runs, ``up``
prints a progress line (step, reward, staleness, drops, workers registered, queue) every
:data:`PROGRESS_EVERY_S` seconds while steps are trained, every :data:`PROGRESS_IDLE_S`
while none is, and one line for each start, exit, restart, stop and scale.

Commands talk to a running ``up`` through two
files in its run directory: ``up.json`` (written by the supervisor: its pid and every
role's state) and ``desired.json`` (written by the commands: replicas and restart
requests), which the supervisor reconciles every half second.

For Prometheus, ``up`` keeps file-based service discovery up to date in
``<run_dir>/prometheus/`` (one file per job, ``rlpipe-learner`` and ``rlpipe-rollout``, the
job names the alerts and dashboard select on, with a stable ``instance`` label per role so
restarts show as changes of ``process_start_time_seconds``) and writes a ``prometheus.yml``
that scrapes them with the alert rules of deploy/k8s.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from launch.gpus import launch_plan
from launch.launcher import LEARNER_GRACE_S, Launcher, kill_group, learner_env, log_tail, signals_held, worker_env
from launch.role_setup import parse_cpus
from rlpipe import registry
from rlpipe.config import RunConfig, secret_env
from rlpipe.readback import number

STATE_FILE, DESIRED_FILE = "up.json", "desired.json"
BACKOFF_FIRST_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 1.0, 30.0, 60.0
USAGE_ERROR = 2  # a role's exit code for a mistake in the config or the fleet: restarting cannot help
START_TRIES = 3  # exits in a row before ever being ready, after which `up` gives up (a broken model dir, a bad key)
PROGRESS_EVERY_S, PROGRESS_IDLE_S = 10.0, 60.0
ROLL_READY_TIMEOUT_S = 300.0  # `restart rollout` goes on to the next worker after this, ready or not
JOBS = {"learner": "rlpipe-learner", "rollout": "rlpipe-rollout"}


@dataclass
class Role:
    """One supervised process: the learner, or worker ``w<i>``."""

    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: object = None  # subprocess.Popen while one runs
    started: float = 0.0  # time.monotonic() of the last start
    started_wall: float = 0.0  # time.time() of it: what the role's own writes to Redis are compared with
    ready: bool = False  # this process got through start-up (see Supervisor._check_ready)
    start_failures: int = 0  # exits in a row before being ready
    restarts: int = 0
    backoff_s: float = 0.0
    next_start: float = 0.0  # crash back-off: not before this time
    stopping_since: float | None = None
    last_exit: int | None = None
    wanted: bool = True

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def state(self) -> str:
        if self.stopping_since is not None:
            return "stopping"
        if self.running:
            return "running"
        return "backoff" if self.wanted else "stopped"


class Supervisor:
    def __init__(self, cfg: RunConfig, run_dir: Path, grace_s: float | None = None, log=print):
        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.cfg_path = run_dir / "config.yaml"
        self.launcher = Launcher(run_dir, secret_env(cfg))
        self.gpus = launch_plan(cfg)  # each role's CUDA devices
        self.grace_s = grace_s if grace_s is not None else cfg.rollout.shutdown_deadline_s + 15
        self.roles: dict[str, Role] = {}
        self.restart_seen: dict[str, int] = {"learner": 0, "rollout": 0}
        self.replicas = cfg.workers
        self.rolling: list[str] = []  # workers `restart rollout` has yet to restart, one at a time
        self.roll_since: float | None = None  # when the first of them was asked to stop
        self.last_progress, self.last_step = time.monotonic(), 0
        self.finished = False
        self.failed: str | None = None  # why `up` gave up
        (run_dir / "addresses").mkdir(exist_ok=True)
        write_desired(run_dir, {"learner": 1, "rollout": cfg.workers, "restart": {}})
        write_prometheus_config(run_dir)

    # -- reconciling ------------------------------------------------------------------
    def tick(self, r) -> None:
        desired = read_desired(self.run_dir)
        if self.cfg.autoscale.enabled:
            self._autoscale(r, desired)
        self._want("learner", desired.get("learner", 1) > 0)
        n = int(desired.get("rollout", self.cfg.workers))
        if n != self.replicas:
            self.log(f"rollout scaled from {self.replicas} to {n} workers")
            self.replicas = n
        for name in [x for x in self.roles if x != "learner"]:
            self._want(name, int(name[1:]) < n)
        for i in range(n):
            self._want(f"w{i}", True)
        for kind, count in desired.get("restart", {}).items():
            if count > self.restart_seen.get(kind, 0):
                self.restart_seen[kind] = count
                learner = self.roles.get("learner")
                if kind == "learner" and learner is not None and learner.running:
                    self.log("restarting learner")
                    self._stop(learner)
                elif kind == "rollout":
                    self.rolling = sorted((x for x, role in self.roles.items() if x != "learner" and role.wanted),
                                          key=lambda x: int(x[1:]))
                    self.roll_since = None
                    self.log(f"restarting {', '.join(self.rolling)}, one at a time")
        self._roll()
        for role in self.roles.values():
            self._reconcile(role, r)
        self._check_ready(r)
        self._write_state()
        write_targets(self.run_dir, r, self.cfg, [n for n, role in self.roles.items() if role.wanted])
        self._progress(r)

    def _autoscale(self, r, desired: dict) -> None:
        """Set the workers to the learner's ``fleet_desired_workers`` (rlpipe/autoscale.py),
        within this run's bounds, as a ``scale rollout`` would: it owns the count while enabled.
        Advice that is not a count (the hash overwritten) is no advice."""
        state = registry.learner_state(r, _keys(self.cfg))
        want = number(state.get("fleet_desired_workers"), "learner fleet_desired_workers", 0, low=0)
        if not want:
            return  # no advice yet (no step trained)
        a = self.cfg.autoscale
        want = min(a.max_workers, max(a.min_workers, want))
        if want != int(desired.get("rollout", self.cfg.workers)):
            self.log(f"autoscale: {want} workers: the learner waited {_share(state, 'fleet_wait_fraction')} of its "
                     f"time for groups, the workers idled {_share(state, 'fleet_idle_fraction')} of theirs")
            desired["rollout"] = want
            write_desired(self.run_dir, desired)

    def _roll(self) -> None:
        """``restart rollout``, one worker at a time: the next once this one is ready again
        (synced and serving), so the fleet never loses more than one worker's throughput."""
        while self.rolling:
            role = self.roles.get(self.rolling[0])
            if role is not None and role.wanted:  # (a worker scaled away meanwhile is skipped)
                if self.roll_since is None:
                    self.log(f"restarting {role.name}")
                    self._stop(role)
                    self.roll_since = time.monotonic()
                    return
                if not (role.ready and role.started > self.roll_since):
                    if time.monotonic() - self.roll_since < ROLL_READY_TIMEOUT_S:
                        return
                    self.log(f"{role.name} is not ready {ROLL_READY_TIMEOUT_S:.0f}s after its restart: "
                             f"going on with the next")
            self.rolling.pop(0)
            self.roll_since = None

    def _want(self, name: str, wanted: bool) -> None:
        if name not in self.roles:
            if not wanted:
                return
            self.roles[name] = self._role(name)
        role = self.roles[name]
        if role.wanted and not wanted and role.running:
            self.log(f"stopping {name}")
            self._stop(role)
        role.wanted = wanted

    def _role(self, name: str) -> Role:
        cfg_arg = ["--config", str(self.cfg_path)]
        if name == "learner":
            return Role(name, ["learner", *cfg_arg], {**learner_env(self.cfg), **self.gpus.learner_env()})

        i = int(name[1:])
        return Role(name, ["rollout", *cfg_arg, "--worker-id", name, "--precision", self.cfg.rollout.worker_precision(i),
                           "--address-file", str(self.run_dir / "addresses" / name)],
                    {**worker_env(i, max(i + 1, self.cfg.worker_slots), parse_cpus(self.cfg.rollout.cpus) or None,
                                 parse_cpus(self.cfg.learner.cpus)),
                     **self.gpus.worker_env(i)})

    def _grace(self, role: Role) -> float:
        """How long a stopping role may take before SIGKILL: a worker's drain, or the learner's step and checkpoint."""
        return max(self.grace_s, LEARNER_GRACE_S) if role.name == "learner" else self.grace_s

    def _stop(self, role: Role) -> None:
        if role.stopping_since is None and role.running:
            role.proc.send_signal(signal.SIGTERM)  # the learner checkpoints, a worker drains
            role.stopping_since = time.monotonic()

    def _reconcile(self, role: Role, r) -> None:
        now = time.monotonic()
        if role.stopping_since is not None:
            if role.proc.poll() is None and now - role.stopping_since < self._grace(role):
                return
            kill_group(role.proc, signal.SIGKILL)  # whatever is left of its process group
            role.proc.wait()
            role.last_exit, role.stopping_since = role.proc.returncode, None
            role.proc, role.next_start = None, now  # asked to stop: no back-off
        if role.proc is not None and role.proc.poll() is not None:  # exited unasked
            kill_group(role.proc, signal.SIGKILL)  # a dead role's engine processes share its group
            role.last_exit, role.proc = role.proc.returncode, None
            if role.name == "learner" and role.last_exit == 0 and \
                    registry.learner_state(r, _keys(self.cfg)).get("status") == "done":
                self.log("the learner trained every step: the run is done")
                self.finished = True
                return
            log_path = self.launcher.log_dir / f"{role.name}.log"
            if role.last_exit == USAGE_ERROR:  # a mistake no restart can mend (a worker that cannot take the weights)
                self.failed = f"{role.name} stopped on an error no restart can fix"
                self.log(f"{role.name} exited with code {USAGE_ERROR}: giving up. The last lines of {log_path}:\n"
                         f"{log_tail(log_path)}")
                return
            if not role.ready:
                role.start_failures += 1
                if role.start_failures >= START_TRIES:
                    self.failed = f"{role.name} kept failing at start"
                    self.log(f"{role.name} exited with code {role.last_exit} before it was ready, "
                             f"{role.start_failures} times in a row: giving up. The last lines of {log_path}:\n"
                             f"{log_tail(log_path)}")
                    return
            ran_s = now - role.started
            role.backoff_s = BACKOFF_FIRST_S if ran_s > BACKOFF_RESET_S or not role.backoff_s \
                else min(BACKOFF_MAX_S, role.backoff_s * 2)
            role.next_start = now + role.backoff_s
            at_start = f" at start (try {role.start_failures} of {START_TRIES})" if not role.ready else ""
            last = log_tail(log_path, 1).strip()
            self.log(f"{role.name} exited with code {role.last_exit}{at_start}; restarting in {role.backoff_s:.0f}s"
                     + (f"; its log ends: {last[:300]}" if last else ""))
        if role.wanted and role.proc is None and now >= role.next_start and not self.finished and not self.failed:
            if role.started:
                role.restarts += 1
            role.proc = self.launcher.spawn(role.name, role.args, role.env)
            role.started, role.started_wall, role.ready = now, time.time(), False
            self.log(f"{role.name} started (pid {role.proc.pid})")

    def _check_ready(self, r) -> None:
        """Mark the roles that got through start-up: the learner once it wrote its state
        (model loaded, Redis reached; its first write is its address), a worker once it has
        registered and answers ``/readyz`` (engine up, weights synced)."""
        starting = [role for role in self.roles.values()
                    if role.running and not role.ready and role.stopping_since is None]
        if not starting:
            return
        keys = _keys(self.cfg)
        workers = registry.live_workers(r, keys) if any(role.name != "learner" for role in starting) else {}
        for role in starting:
            if role.name == "learner":
                heartbeat = registry.learner_state(r, keys).get("heartbeat")
                ready = number(heartbeat, "learner heartbeat", 0.0, float) >= role.started_wall
            else:
                fields = workers.get(role.name, {})
                ready = number(fields.get("heartbeat"), "worker heartbeat", 0.0, float) >= role.started_wall and \
                    _answers_ready(fields.get("address", ""))
            if ready:
                role.ready, role.start_failures = True, 0
                self.log(f"{role.name} ready")

    def _progress(self, r) -> None:
        """One line on how training goes, every PROGRESS_EVERY_S while steps are trained,
        every PROGRESS_IDLE_S while none is (so a stall shows as the same step again)."""
        now = time.monotonic()
        keys = _keys(self.cfg)
        state = registry.learner_state(r, keys)
        step = number(state.get("step"), "learner step", 0)
        if now - self.last_progress < (PROGRESS_EVERY_S if step != self.last_step else PROGRESS_IDLE_S):
            return
        self.last_progress, self.last_step = now, step
        from rlpipe.queue import TrajectoryQueue

        parts = [f"step {step}/{self.cfg.steps}"]
        if state.get("status", "running") != "running":
            parts.append(f"learner {state.get('status', 'starting')}")
        row = last_row(self.run_dir / "metrics.jsonl")
        if row:
            parts += [f"reward {row['reward_mean']:.3f}", f"staleness {row['staleness_mean']:.2f}",
                      f"dropped {row.get('dropped_stale_step', 0)}"]
        parts += [f"workers {len(registry.live_workers(r, keys))}/{self.replicas} registered",
                  f"queue {TrajectoryQueue(r, self.cfg.run_id).length()}"]
        self.log("  ".join(parts))

    def _write_state(self) -> None:
        now = time.monotonic()
        roles = {name: {"state": role.state(), "pid": role.proc.pid if role.running else None,
                        "restarts": role.restarts, "last_exit": role.last_exit,
                        "uptime_s": round(now - role.started, 1) if role.running else 0.0}
                 for name, role in self.roles.items()}
        _write_json(self.run_dir / STATE_FILE, {"pid": os.getpid(), "run_id": self.cfg.run_id, "roles": roles,
                                                "finished": self.finished})

    def stop_all(self) -> None:
        """The learner first, given LEARNER_GRACE_S to finish its step, sync it to the workers
        still serving and checkpoint; then the workers (they drain). SIGKILL what outlives
        its grace."""
        for role in self.roles.values():
            role.wanted = False
        learner = self.roles.get("learner")
        if learner is not None and learner.running:
            self.log("stopping learner (it finishes the step in hand and checkpoints)")
            self._stop(learner)
            self._wait_stopped([learner], self._grace(learner))
        workers = [role for name, role in self.roles.items() if name != "learner"]
        if any(role.running for role in workers):
            self.log(f"stopping {', '.join(role.name for role in workers if role.running)}")
        for role in workers:
            self._stop(role)
        self._wait_stopped(self.roles.values(), self.grace_s)

    def _wait_stopped(self, roles, grace_s: float) -> None:
        roles = list(roles)
        deadline = time.monotonic() + grace_s
        while any(role.running for role in roles) and time.monotonic() < deadline:
            time.sleep(0.2)
        for role in roles:
            if role.proc is not None:
                if role.running:
                    self.log(f"{role.name} still running after {grace_s:.0f}s: killed")
                kill_group(role.proc, signal.SIGKILL)
                role.proc.wait()
                role.last_exit, role.proc, role.stopping_since = role.proc.returncode, None, None


def _share(state: dict, key: str) -> str:
    share = number(state.get(key), f"learner {key}", None, float)
    return "?" if share is None else f"{share:.0%}"


def _answers_ready(address: str) -> bool:
    import httpx

    if not address:
        return False
    try:
        return httpx.get(f"http://{address}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def last_row(path: Path) -> dict:
    """The last complete step row of a metrics.jsonl ({} if none), without reading it all."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:  # a line being written, or the cut first one
            continue
        if row.get("kind", "step") == "step":  # not a held-out evaluation's row
            return row
    return {}


def _keys(cfg: RunConfig):
    from rlpipe.keys import Keys

    return Keys(cfg.run_id)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_desired(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / DESIRED_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_desired(run_dir: Path, desired: dict) -> None:
    _write_json(run_dir / DESIRED_FILE, desired)


# -- Prometheus -------------------------------------------------------------------------
def write_targets(run_dir: Path, r, cfg: RunConfig, roles: list[str]) -> None:
    """File-based service discovery: each wanted role's last known address. A role being
    restarted keeps its old address until the new process publishes one, so Prometheus
    sees it down (``up == 0``) rather than gone, as with a restarting container."""
    out = run_dir / "prometheus"
    learner = []
    if "learner" in roles:
        address = registry.learner_state(r, _keys(cfg)).get("address")
        if address:
            learner.append({"targets": [address], "labels": {"instance": "learner", "run_id": cfg.run_id}})
    workers = []
    for name in sorted(x for x in roles if x != "learner"):
        path = run_dir / "addresses" / name
        if path.exists():
            workers.append({"targets": [path.read_text().strip()], "labels": {"instance": name, "run_id": cfg.run_id}})
    for job, groups in (("learner", learner), ("rollout", workers)):
        path = out / f"targets-{job}.json"
        # only on a change: Prometheus re-reads discovery files whenever they are written
        if not path.exists() or json.loads(path.read_text()) != groups:
            _write_json(path, groups)


def write_prometheus_config(run_dir: Path, scrape_interval: str = "5s", rule_files: list[str] | None = None,
                            name: str = "prometheus.yml") -> Path:
    out = run_dir / "prometheus"
    out.mkdir(exist_ok=True)
    for job in JOBS:
        if not (out / f"targets-{job}.json").exists():
            _write_json(out / f"targets-{job}.json", [])
    if rule_files is None:
        rule_files = [str(extract_rules(out / "rules.yml"))]
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "rule_files": rule_files,
        # honor_labels: a series' own run_id stands (the target's, for `up`, is the same run's)
        "scrape_configs": [{"job_name": JOBS[job], "honor_labels": True, "file_sd_configs": [
            {"files": [str(out / f"targets-{job}.json")], "refresh_interval": "1s"}]} for job in JOBS],
    }
    path = out / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


RULES = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "base" / "monitoring" / "prometheusrule.yaml"


def extract_rules(path: Path) -> Path:
    """The alert rules of the PrometheusRule in deploy/k8s as a plain rules file."""
    if RULES.exists():
        spec = yaml.safe_load(RULES.read_text())["spec"]
    else:  # an installed package without the deploy tree
        spec = {"groups": []}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# -- the commands -------------------------------------------------------------------------
def run_up(cfg: RunConfig, runs_dir: str = "runs", progress: bool = True) -> int:
    """Supervise until the learner is done (0), Ctrl-C or SIGTERM (130), or a role that
    keeps failing at start or Redis lost for good (1); the summary is printed each time."""
    from launch.demo import _summarize, format_summary, prepare_run
    from rlpipe.redis_link import RedisUnavailable, connect

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    t_start = time.time()
    cfg, run_dir, redis_server = prepare_run(cfg, runs_dir, say)
    sup, interrupted = None, False
    try:
        r = connect(cfg.redis_url, cfg.redis_wait_s)
        sup = Supervisor(cfg, run_dir, log=lambda m: say(f"rlpipe up: {m}"))
        say(f"rlpipe up: supervising the learner and {cfg.workers} workers; `rlpipe status --run-dir {run_dir}`; "
            f"Prometheus: prometheus --config.file {run_dir / 'prometheus' / 'prometheus.yml'}")
        while not sup.finished and not sup.failed:
            sup.tick(r)
            time.sleep(0.5)
    except KeyboardInterrupt:
        interrupted = True
        say("rlpipe up: stopping every role")
    except RedisUnavailable as e:
        say(f"rlpipe up: {e}: stopping every role")
    finally:
        with signals_held(say):
            if sup is not None:
                sup.stop_all()
                sup._write_state()
            summary = _summarize(cfg, run_dir, t_start, sup is not None and sup.finished, interrupted)
            if redis_server:
                redis_server.stop()
    say(format_summary(summary, "rlpipe up summary"))
    if sup is not None and sup.failed:
        say(f"rlpipe up: stopped because {sup.failed} (its log's last lines are above)")
    return 0 if summary["completed"] else 130 if interrupted else 1


def find_run(run_dir: str | None, runs_dir: str = "runs") -> Path:
    """The run directory of a live ``rlpipe up``: the one given, else the newest under ``runs_dir``."""
    if run_dir:
        path = Path(run_dir)
        if not (path / STATE_FILE).exists():
            raise FileNotFoundError(f"--run-dir: {path} has no {STATE_FILE} (not started by `rlpipe up`)")
        return path
    found = sorted(Path(runs_dir).glob(f"*/{STATE_FILE}"), key=lambda p: p.stat().st_mtime)
    live = [p.parent for p in found if _alive(json.loads(p.read_text()).get("pid"))]
    if not live:
        raise FileNotFoundError(f"no running `rlpipe up` under {runs_dir}/ (give --run-dir)")
    return live[-1]


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True


def request(run_dir: Path, kind: str, replicas: int | None = None) -> str:
    """``restart`` (replicas None) or ``scale`` a role kind of a running ``up``."""
    if kind not in JOBS:
        raise ValueError(f"role: {kind!r} is not one of {', '.join(JOBS)}")
    state = json.loads((run_dir / STATE_FILE).read_text())
    if not _alive(state.get("pid")):
        raise FileNotFoundError(f"the `rlpipe up` of {run_dir} is not running")
    desired = read_desired(run_dir)
    if replicas is None:
        desired.setdefault("restart", {})[kind] = desired.get("restart", {}).get(kind, 0) + 1
        msg = f"restart of {kind} requested"
    else:
        if replicas < 0 or (kind == "learner" and replicas > 1):
            raise ValueError(f"replicas: {replicas} is out of range for {kind} (learner: 0 or 1)")
        desired[kind] = replicas
        msg = f"{kind} scaled to {replicas}"
    write_desired(run_dir, desired)
    return msg


def status_table(run_dir: Path) -> str:
    """Roles from the supervisor, versions and sync from the learner's ``/status`` (or the
    registry while the learner is down), and the queue from Redis."""
    import httpx

    from rlpipe.auth import api_token
    from rlpipe.config import load_config
    from rlpipe.queue import TrajectoryQueue
    from rlpipe.redis_link import connect

    state = json.loads((run_dir / STATE_FILE).read_text())
    cfg = load_config(run_dir / "config.yaml")
    r = connect(cfg.redis_url, 5)
    keys = _keys(cfg)
    learner = registry.learner_state(r, keys)
    workers: dict[str, dict] = {}
    if learner.get("address"):
        headers = {"Authorization": f"Bearer {api_token()}"} if api_token() else {}
        try:
            workers = httpx.get(f"http://{learner['address']}/status", headers=headers, timeout=3).json()["workers"]
        except (httpx.HTTPError, KeyError, ValueError):
            pass
    if not workers:
        version = number(learner.get("version"), "learner version", 0)
        workers = {w: {"version": (v := number(f.get("version"), "worker version", -1)), "behind": version - v,
                       "generation": f.get("generation", ""), "precision": f.get("precision", "")}
                   for w, f in registry.live_workers(r, keys).items()}
    lines = [f"run {state['run_id']} (supervisor pid {state['pid']}{', finished' if state.get('finished') else ''})",
             f"{'role':<9} {'state':<9} {'pid':>7} {'restarts':>8} {'uptime':>8}  {'version':>7} {'lag':>4} "
             f"{'generation':>10}  sync"]
    for name, role in state["roles"].items():
        if name == "learner":
            ver, lag, gen, sync = learner.get("version", "-"), "", learner.get("generation", ""), \
                f"step {learner.get('step', '-')}/{cfg.steps} {learner.get('status', '')}"
        else:
            w = workers.get(name, {})
            ver, lag, gen = w.get("version", "-"), w.get("behind", ""), w.get("generation", "")
            sync = "left out" if w.get("left_out") else "member" if w.get("member") else \
                ("registered" if w else "not registered")
        lines.append(f"{name:<9} {role['state']:<9} {role['pid'] or '-':>7} {role['restarts']:>8} "
                     f"{role['uptime_s']:>7.0f}s  {ver:>7} {lag:>4} {gen:>10}  {sync}")
    q = TrajectoryQueue(r, cfg.run_id)
    c = q.counters()
    lines.append(f"queue: {q.length()} waiting, {q.pending()} read not yet acknowledged; produced {c['produced']}, "
                 f"trained {c['trained']}, dropped stale {c['dropped_stale']}, dead {c['dead']}")
    return "\n".join(lines)
