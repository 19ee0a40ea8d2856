"""The link to Redis: the client every process talks through, and what it does when Redis goes away.

Its own module because every process connects (the learner, the workers, the launcher, the
tools and tests) and most never touch the trajectory queue; and because rlpipe/config.py needs
the password's environment variable without importing the queue. It imports nothing of rlpipe's.

``connect`` gives a client whose every call has a timeout and, for the services, waits through
an outage (:class:`OutageRetry`) up to ``redis_wait_s``; :class:`RestartWatch` tells a process
that the server restarted, so it reconciles what a restart may have lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)


class RedisUnavailable(RuntimeError):
    """Redis stayed unreachable longer than the process may wait (``redis_wait_s``)."""


PASSWORD_ENV, PASSWORD_FILE_ENV = "RLPIPE_REDIS_PASSWORD", "RLPIPE_REDIS_PASSWORD_FILE"


def redis_password() -> str | None:
    """The password for a ``redis_url`` without one: ``RLPIPE_REDIS_PASSWORD``, or the file
    named by ``RLPIPE_REDIS_PASSWORD_FILE`` (a mounted Kubernetes secret); None for neither."""
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    if os.environ.get(PASSWORD_FILE_ENV):
        return Path(os.environ[PASSWORD_FILE_ENV]).read_text().strip()
    return None


def redacted(url: str) -> str:
    """``url`` without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rsplit("@", 1)[1]))


class OutageRetry(Retry):
    """Retry every Redis call through an outage (a restart, a failover) until ``wait_s``
    have passed since it began, with capped exponential backoff; then raise
    :class:`RedisUnavailable`. It logs once when an outage begins and once when it ends,
    rather than a traceback per call, and counts outages (``outages``) so the learner and
    workers know to reconcile what a restarted Redis may have lost.

    redis-py deep-copies the retry policy into every connection; one object per client
    (``__deepcopy__`` returns itself) is what makes an outage one outage for all of them.
    """

    def __init__(self, url: str, wait_s: float, password: str | None = None):
        super().__init__(ExponentialBackoff(cap=2.0, base=0.05), retries=-1)
        self.url, self.wait_s = redacted(url), wait_s
        self._probe_url, self._password = url, password
        self.down_since: float | None = None
        self.outages = 0
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as e:
                if is_retryable and not is_retryable(e):
                    raise
                failures += 1
                fail(e, failures) if with_failure_count else fail(e)
                self._down(e)
                time.sleep(self._backoff.compute(failures))
                continue
            self._up()
            return result

    def _serving(self) -> bool:
        """A success is not proof Redis is back: redis-py's ``connect()`` succeeds at once on
        a connection whose socket is still open to the dead server, and a restarted Redis
        answers a few commands while it replays its AOF, refusing the rest with LOADING (one
        thread's call succeeding while another's is refused made one outage look like
        several). Back means a fresh connection finds it done loading."""
        try:
            auth = {"password": self._password} if self._password is not None else {}
            probe = redis.Redis.from_url(self._probe_url, socket_timeout=1.0, socket_connect_timeout=1.0, **auth)
            try:
                return not int(probe.info("persistence").get("loading", 0))
            finally:
                probe.close()
        except (redis.RedisError, OSError):
            return False

    def _down(self, error: Exception) -> None:
        with self._lock:
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
                self.outages += 1
                log.warning("Redis at %s unreachable (%s): retrying for up to %.0fs", self.url, error, self.wait_s)
            elif now - self.down_since > self.wait_s:
                raise RedisUnavailable(f"Redis at {self.url} unreachable for {now - self.down_since:.0f}s "
                                       f"(redis_wait_s {self.wait_s:g}): {error}") from error

    def _up(self) -> None:
        if self.down_since is not None and self._serving():
            with self._lock:
                if self.down_since is not None:
                    log.warning("Redis at %s is back after %.1fs", self.url, time.monotonic() - self.down_since)
                    self.down_since = None


def connect(url: str, wait_s: float = 0.0) -> redis.Redis:
    """A client whose every call has a timeout (no call may hang a process forever).

    With ``wait_s > 0`` (the services: ``redis_wait_s``) it waits for Redis, at start and
    through any later outage, up to ``wait_s`` each time (:class:`OutageRetry`); without,
    a call fails at once (tools, tests). The password comes from the URL or, failing
    that, :func:`redis_password`.
    """
    kwargs = dict(socket_timeout=30, socket_connect_timeout=10, health_check_interval=30)
    password = redis_password() if urlsplit(url).password is None else None
    if password is not None:
        kwargs["password"] = password
    if wait_s > 0:
        kwargs.update(retry=OutageRetry(url, wait_s, password), retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    client = redis.Redis.from_url(url, **kwargs)
    if wait_s > 0:
        client.ping()  # at start: waits (saying so) up to wait_s, then RedisUnavailable names the URL
    return client


class RestartWatch:
    """Whether the Redis server behind ``r`` restarted since the last look: its ``run_id``
    changed. Only a restart can lose writes Redis acknowledged (a network outage loses
    none), and a process may never see the outage itself: redis-py quietly reconnects a
    pooled connection whose server went away while the process made no call (the learner
    in a long weight sync). So the run_id, not an error, is what tells it to reconcile."""

    def __init__(self, r: redis.Redis, every_s: float = 0.0):
        self.r, self.every_s = r, every_s
        self.run_id = self._run_id()
        self.checked = time.monotonic()

    def _run_id(self) -> str:
        return self.r.info("server")["run_id"]

    def restarted(self) -> bool:
        """True once per restart (at most one look per ``every_s``)."""
        if time.monotonic() - self.checked < self.every_s:
            return False
        self.checked = time.monotonic()
        run_id = self._run_id()
        changed, self.run_id = run_id != self.run_id, run_id
        return changed


def outages(r: redis.Redis) -> int:
    """How many outages ``r`` has been through (0 for a client without OutageRetry)."""
    retry = r.get_retry()
    return retry.outages if isinstance(retry, OutageRetry) else 0

