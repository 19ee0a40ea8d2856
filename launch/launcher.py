"""The local launcher: owns the run directory, the child processes and their logs.

Each role runs as ``python -m launch.cli <role> ...`` in its own process session, with
its output in ``runs/<id>/logs/<name>.log`` and its command line in
``runs/<id>/commands.txt``. Children are stopped by process group (SIGTERM, then SIGKILL
after a grace period), which takes vLLM's engine processes with them; and each child
stops itself if the launcher dies (``RLPIPE_PARENT_PID``, see launch/role_setup.py).

Stopping a run goes in one order (:meth:`Launcher.stop_all`, and ``rlpipe up`` likewise):
the learner first, given :data:`LEARNER_GRACE_S` to finish the step in hand, sync it and
checkpoint while the workers and Redis still serve it; then the workers (they drain);
Redis, which runs in a session of its own so a terminal's Ctrl-C never reaches it, last.
While that runs, a second Ctrl-C or SIGTERM is noted, not obeyed (:func:`signals_held`):
it would break the stop half-way and lose the step.

A learner with ``learner.ranks`` above 1 re-executes itself under ``torchrun`` (see
:func:`torchrun_command`), whose ranks each lead a process session of their own: stopping
a child therefore signals the process groups of its whole tree (:func:`kill_group`).

Weight sync between the children is authenticated: a run started without a sync token
(``RLPIPE_SYNC_TOKEN`` or ``RLPIPE_API_TOKEN``, rlpipe/auth.py) gets a random one of its
own, in its children's environment only (never in commands.txt), so even a local run's
learner admits only its own workers. Other secrets (a password in ``REDIS_URL``) reach the
children the same way: the run's config.yaml is written without them (rlpipe.config
``without_secrets`` / ``secret_env``).

A run directory is its owner's alone: created mode 0700, its logs and command list 0600,
and the children run with umask 077, so metrics and checkpoints are private too.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

from launch.role_setup import AFFINITY_ENV, NICE_ENV, SHARED_CORE_NICE, parse_cpus
from rlpipe.auth import SYNC_TOKEN_ENV, sync_token
from rlpipe.config import ConfigError

# Environment every role gets: no hub, no telemetry, quiet vLLM.
ROLE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # The working directory is not put first on a role's import path, where a folder of the user's
    # named like one of rlpipe's packages (launch/, learner/) would be imported instead of rlpipe's;
    # launch/cli.py puts it last, once rlpipe's packages are imported (a user's reward module there
    # still imports).
    "PYTHONSAFEPATH": "1",
}


# How long a stopping learner may take: the step in hand (its groups are in hand or it stops
# waiting at once), that step's weight sync, and a checkpoint.
LEARNER_GRACE_S = 90.0
LOG_TAIL_LINES = 20  # how much of a failed role's log a launcher shows


class ChildFailed(RuntimeError):
    """A role exited with an error: one line naming it, its exit code and its log (``tail``:
    the log's last lines, for a caller that shows more)."""

    def __init__(self, role: str, code: int, log: Path, tail: str):
        super().__init__(f"{role} exited with code {code}; its log: {log}")
        self.role, self.code, self.log, self.tail = role, code, log, tail


def make_run_dir(runs_dir: str | Path, run_id: str) -> Path:
    """``<runs_dir>/<run_id>``, created mode 0700; one that cannot be made (a file in the
    way, no permission) is a ConfigError naming ``--runs-dir``."""
    run_dir = Path(runs_dir).resolve() / run_id
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        run_dir.chmod(0o700)
    except OSError as e:
        raise ConfigError(f"--runs-dir: cannot create {run_dir}: {e.strerror or e}") from None
    return run_dir


def _private(path: str, flags: int) -> int:
    """``open(..., opener=_private)``: a new file readable by its owner only."""
    return os.open(path, flags, 0o600)


class Launcher:
    def __init__(self, run_dir: str | Path, secret_env: dict[str, str] | None = None):
        """``secret_env``: variables for every child that must not be written down (never in
        commands.txt), e.g. rlpipe.config.secret_env of the run's config."""
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        own_token = {} if sync_token() else {SYNC_TOKEN_ENV: secrets.token_hex(32)}
        self.secret_env = {**own_token, **(secret_env or {})}

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "launch.cli", *args]
        full_env = {**os.environ, **ROLE_ENV, **self.secret_env, **(env or {}), "RLPIPE_PARENT_PID": str(os.getpid())}
        with open(self.log_dir / f"{name}.log", "ab", opener=_private) as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True, cwd=os.getcwd(), umask=0o077)
        cpus = parse_cpus(full_env.get(AFFINITY_ENV, ""))
        if cpus:  # from its start on: the role pins itself too, but only once it has imported rlpipe
            try:
                os.sched_setaffinity(proc.pid, cpus)
            except ProcessLookupError:  # exited at once: check() reports it
                pass
        extra = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        with open(self.run_dir / "commands.txt", "a", opener=_private) as f:
            f.write(f"{name}: {extra} {shlex.join(cmd)}\n")
        self.procs[name] = proc
        return proc

    def check(self) -> None:
        """Raise ChildFailed if any child has exited with an error."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code not in (None, 0):
                raise ChildFailed(name, code, self.log_dir / f"{name}.log", self.log_tail(name))

    def log_tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_dir / f"{name}.log", lines)

    def wait(self, name: str, timeout_s: float) -> int | None:
        """Child ``name``'s exit code once it exits, or None if it runs ``timeout_s`` longer."""
        try:
            return self.procs[name].wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, name: str, grace_s: float = 20.0) -> None:
        self._stop([self.procs[name]], grace_s)

    def stop_all(self, grace_s: float = 20.0) -> None:
        """The learner first (it checkpoints while the workers can still take its last sync),
        then every other child."""
        if "learner" in self.procs:
            self._stop([self.procs["learner"]], max(grace_s, LEARNER_GRACE_S))
        self._stop(list(self.procs.values()), grace_s)

    @staticmethod
    def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
        """SIGTERM each role's main process (it shuts its engine down in order), wait,
        then SIGKILL whatever is left of each process group."""
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            kill_group(proc, signal.SIGKILL)
            proc.wait()


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' if there is none yet)."""
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def signals_held(say):
    """While a launcher stops its run: SIGINT and SIGTERM only say that the stop is under
    way. (A second Ctrl-C would otherwise raise in the middle of it: roles left running,
    Redis stopped under the learner, no summary.) Each stop is bounded by its grace."""
    def note(signum, frame):
        say(f"already stopping (the learner finishes its step and checkpoints; at most {LEARNER_GRACE_S:.0f}s)")

    if threading.current_thread() is not threading.main_thread():  # only there can signals be handled
        yield
        return
    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the child's process group (it leads its own session, so this reaches the
    engine processes it started) and to every group one of its descendants leads: torchrun
    starts each learner rank in a session of its own, out of reach of the first."""
    groups = [proc.pid]
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:  # gone already: its descendants (if any) were re-parented
        children = []
    for child in children:
        try:
            if os.getpgid(child.pid) == child.pid:
                groups.append(child.pid)
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


def torchrun_command(cfg, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``rlpipe <argv>`` (a learner) as ``cfg.learner.ranks``
    data-parallel ranks on this machine: ``python -m torch.distributed.run --standalone
    --nproc-per-node N -m launch.cli <argv>``. torchrun forwards SIGTERM to every rank (the
    learner's graceful stop) and SIGKILLs what is left after its shutdown timeout. Each rank
    gets ``learner.threads`` threads, or its share of this process's cores, in
    ``OMP_NUM_THREADS`` (torch's default thread count; torchrun would otherwise give it 1).

    With ``learner.nodes`` above 1, each node's torchrun meets the others at
    ``learner.rendezvous`` (a TCP store on node 0) through torchrun's *static* rendezvous:
    global rank = ``node_rank * ranks + local rank``, so rank 0, which holds the lease,
    Redis and the checkpoints, is always node 0's first process, on every restart (a c10d
    dynamic rendezvous would number the nodes by arrival). ``--max-restarts 0``: a node
    that dies fails the others at their next collective, every torchrun exits, and the
    supervisor (``rlpipe up``, the StatefulSet) restarts the learner from its checkpoint."""
    lc = cfg.learner
    threads = lc.threads or max(1, len(os.sched_getaffinity(0)) // lc.ranks)
    if lc.nodes > 1:
        meet = ["--nnodes", str(lc.nodes), "--node-rank", str(lc.node_rank), "--rdzv-backend", "static",
                "--rdzv-endpoint", lc.rendezvous, "--max-restarts", "0"]
    else:
        meet = ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *meet, "--nproc-per-node", str(lc.ranks),
           "-m", "launch.cli", *argv]
    return cmd, {**os.environ, "OMP_NUM_THREADS": str(threads)}


def worker_env(index: int, n_workers: int, cores: list[int] | None = None,
               learner_cores: list[int] = ()) -> dict[str, str]:
    """Give worker ``index`` its share of ``cores`` (``rollout.cpus``; by default this
    machine's): an equal slice when there are more cores than workers, else one core each,
    round-robin. The engine runs in the worker's process tree with vLLM's own OpenMP binding
    off (the ``uni`` executor, rollout_service/vllm_compat.py), so this mask and
    ``OMP_NUM_THREADS`` are all that place it.

    A worker given one of ``learner_cores`` (``learner.cpus``) runs at the lowest priority
    (nice 19): it takes that core while the learner waits for groups, and yields it to the
    learner's step at once, so the learner trains as fast as alone and its idle time becomes
    rollout."""
    cores = cores or sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n_workers)
    mine = [cores[(index * per + k) % len(cores)] for k in range(per)]
    env = {AFFINITY_ENV: ",".join(map(str, mine)), "OMP_NUM_THREADS": str(per)}
    if set(mine) & set(learner_cores):
        env[NICE_ENV] = str(SHARED_CORE_NICE)
    return env


def learner_env(cfg) -> dict[str, str]:
    """Pin the learner to ``learner.cpus`` (none: ``{}``), with one OMP thread per core (or
    ``learner.threads``); with several ranks torchrun inherits the mask and
    :func:`torchrun_command` gives each rank its share of it."""
    cores = parse_cpus(cfg.learner.cpus)
    if not cores:
        return {}
    threads = cfg.learner.threads or max(1, len(cores) // cfg.learner.ranks)
    return {AFFINITY_ENV: ",".join(map(str, cores)), "OMP_NUM_THREADS": str(threads)}
