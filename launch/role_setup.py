"""What a role process that the launcher starts does to set itself up, before anything else
runs (launch/cli.py): logging, CPU pinning and nice (``RLPIPE_CPU_AFFINITY``,
``RLPIPE_NICE``, set by launch/launcher.py), the orphan guard, and the check that its port
is free; and the CPU-list notation the launcher plans with."""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
import time

from rlpipe.proc import bind_socket


def setup_logging(role: str, level: str | None = None) -> None:
    logging.basicConfig(
        level=level or os.environ.get("RLPIPE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


AFFINITY_ENV = "RLPIPE_CPU_AFFINITY"
NICE_ENV = "RLPIPE_NICE"  # a worker that shares a core with the learner yields it (launch.launcher.worker_env)
SHARED_CORE_NICE = 19


def parse_cpus(spec: str) -> list[int]:
    """A CPU list such as ``"0"``, ``"0-3"`` or ``"0,2-3"`` (the kernel's own notation, as in
    ``taskset -c``) as sorted core ids; ``""`` is the empty list."""
    cpus: set[int] = set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def apply_cpu_affinity() -> list[int]:
    """Pin this process to the cores in ``RLPIPE_CPU_AFFINITY`` (set by the launcher from
    ``rollout.cpus`` / ``learner.cpus``), so a role keeps its own cores. Called before
    anything starts threads or children: vLLM's engine process and torchrun's learner
    ranks inherit the mask. ``RLPIPE_NICE`` lowers the priority the same way (a worker on
    the learner's core). Returns the cores (empty: unset, left as it was)."""
    cpus = parse_cpus(os.environ.get(AFFINITY_ENV, ""))
    if cpus:
        os.sched_setaffinity(0, cpus)
    nice = int(os.environ.get(NICE_ENV) or 0)
    if nice > os.getpriority(os.PRIO_PROCESS, 0):  # inherited by the engine process, as the mask is
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    return cpus


def exit_with_parent() -> None:
    """If the launcher that started us dies (even by SIGKILL), stop ourselves cleanly.

    The launcher passes its pid in ``RLPIPE_PARENT_PID``; a daemon thread checks once a
    second and sends this process SIGTERM when the parent is gone (a clean shutdown),
    then SIGKILL to its whole process group if that has not finished within 15 s, so no
    role, nor any process it started, outlives its run as an orphan. A learner rank under
    torchrun (``learner.ranks`` > 1) is the launcher's grandchild: it stops when the
    torchrun agent that started it is gone, or the agent's own parent is no longer the
    launcher.
    """
    parent = os.environ.get("RLPIPE_PARENT_PID")
    if not parent:
        return
    parent_pid = int(parent)
    agent_pid = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None

    def orphaned() -> bool:
        if agent_pid is None:
            return os.getppid() != parent_pid
        return os.getppid() != agent_pid or parent_of(agent_pid) != parent_pid

    def watch():
        while True:
            time.sleep(1.0)
            if orphaned():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(15)
                os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def parent_of(pid: int) -> int | None:
    """The parent pid of process ``pid`` (None if there is no such process)."""
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def check_listen(section: str, host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, so a port in use (or an address this machine
    does not have) is a ConfigError naming ``<section>.port`` (``.host``) before anything
    starts, rather than a traceback once the model has loaded."""
    from rlpipe.config import ConfigError

    try:
        bind_socket(host, port).close()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"{section}.port: {port} is already in use on {host}") from None
        raise ConfigError(f"{section}.host: cannot listen on {host}:{port}: {e.strerror or e}") from None
