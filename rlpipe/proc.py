"""Process plumbing shared by every role: the death signal for a child, a listening socket bound
before its server starts, and a process's start time. What a role process started by the
launcher does to set itself up (logging, CPU pinning, the orphan guard) is launch/role_setup.py."""

from __future__ import annotations

import ctypes
import os
import signal
import socket


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent dies (Linux prctl).

    Used as ``preexec_fn`` for children that are not Python roles (redis-server), and by
    vLLM's engine process; it survives ``exec``. Returns False where unsupported.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except OSError:  # not Linux
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket bound before the server starts, so port 0 yields a known port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def process_start_ticks(pid: int) -> str:
    """When process ``pid`` started, in clock ticks since boot ('' if there is no such
    process): with the pid it names one process, even after the pid is reused."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def process_age_s() -> float:
    """Seconds since this process started (interpreter start-up and imports included)."""
    uptime = float(open("/proc/uptime").read().split()[0])
    return uptime - int(process_start_ticks(os.getpid())) / os.sysconf("SC_CLK_TCK")
