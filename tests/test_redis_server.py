"""The embedded Redis (starts on a free loopback port with AOF on, persists, stops) and
how the services connect to it: through restarts, before it is up, with a password."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import redis

from launch.redis_server import EmbeddedRedis
from rlpipe.config import build_config, dump_config
from rlpipe.redis_link import PASSWORD_ENV, PASSWORD_FILE_ENV, RestartWatch, connect, outages


def test_embedded_redis_persists_through_a_restart(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.xadd("s", {"k": "v"})
        port = server.port
    assert not list(tmp_path.glob("*.pid"))
    with EmbeddedRedis(tmp_path, port=0) as again:  # a new process reads the append-only file
        assert redis.Redis.from_url(again.url).xlen("s") == 1
    assert server.proc is None and port


def test_a_client_rides_out_a_redis_restart_with_one_line_each_way(tmp_path, caplog):
    """SIGKILL redis-server, bring it back 1.5 s later on the same port and directory: calls
    made meanwhile wait and succeed; the outage is logged once and counted once."""
    server = EmbeddedRedis(tmp_path, password="pw-in-env").start()
    os.environ[PASSWORD_ENV] = "pw-in-env"
    try:
        client = connect(server.url, wait_s=30)
        client.set("k", "before")
        time.sleep(1.2)  # AOF everysec: on disk by now
        server.kill()
        got = []

        def calls():  # meanwhile, in another thread (the server must be started from this one:
            got.append(client.get("k"))  # it dies with the thread that started it, see redis_server)
            got.extend(client.incr("n") for _ in range(20))

        with caplog.at_level(logging.WARNING, logger="rlpipe.redis_link"):
            caller = threading.Thread(target=calls)
            caller.start()
            time.sleep(1.5)
            assert not got  # still waiting
            server.start()
            caller.join(30)
        assert got == [b"before", *range(1, 21)] and outages(client) == 1  # "k" survived in the AOF
        lines = [r.getMessage() for r in caplog.records]
        assert sum("unreachable" in m for m in lines) == 1 and sum("is back" in m for m in lines) == 1, lines
    finally:
        os.environ.pop(PASSWORD_ENV, None)
        server.stop()


def test_redis_is_back_only_once_it_has_replayed_its_aof(tmp_path, caplog):
    """A restarted Redis answers a few commands (INFO) while it replays its AOF and refuses
    the rest (LOADING). An INFO answered then must not end the outage (another thread's
    next call would fail again and start a second one: the chaos test saw a worker log
    'is back' three times for one restart): it ends, logged and counted once, when a
    call finds Redis done loading."""
    server = EmbeddedRedis(tmp_path).start()
    try:
        client = connect(server.url, wait_s=30)
        client.set("k", "before")
        server.kill()
        # An AOF of 1,000,000 SETs (75 MB) takes Redis seconds to replay.
        value = b"x" * 40
        (tmp_path / "appendonly.aof").write_bytes(b"".join(
            b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$40\r\n%s\r\n" % (len(key), key, value)
            for key in (b"key:%d" % i for i in range(1_000_000))))
        seen = []  # (time, loading) of each INFO answered

        def reads():
            while not seen or seen[-1][1]:
                seen.append((time.time(), int(client.info("persistence")["loading"])))
                time.sleep(0.02)

        with caplog.at_level(logging.WARNING, logger="rlpipe.redis_link"):
            reader = threading.Thread(target=reads)
            reader.start()
            server.start()  # returns once loaded; the reader's calls race the replay
            reader.join(30)
            assert client.incr("n") == 1 and client.get("k") is None  # the AOF replaced
        back = [r for r in caplog.records if "is back" in r.getMessage()]
        lines = [r.getMessage() for r in caplog.records]
        assert any(loading for _, loading in seen), "the replay was too quick to test anything"
        assert len(back) == 1 and sum("unreachable" in m for m in lines) == 1 and outages(client) == 1, lines
        assert back[0].created > max(t for t, loading in seen if loading), "'back' while still loading"
    finally:
        server.stop()


def test_redis_down_at_start_waits_then_names_the_url(tmp_path, toy_model_path):
    """The learner with no Redis: says it is waiting, gives up after redis_wait_s with the
    URL (password redacted) and exit code 3, no traceback."""
    cfg = build_config({}, environ={}, run_dir=str(tmp_path), redis_url="redis://:hunter2@127.0.0.1:1/0",
                       redis_wait_s=2.0, **{"model.path": toy_model_path})
    dump_config(cfg, tmp_path / "config.yaml")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launch.cli", "learner", "--config", str(tmp_path / "config.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "rlpipe: error: Redis at redis://:***@127.0.0.1:1/0 unreachable" in out.stderr
    assert "hunter2" not in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - t0 >= 2.0


def test_the_password_comes_from_the_url_the_environment_or_a_file(tmp_path, monkeypatch):
    with EmbeddedRedis(tmp_path / "r", password="from-a-file") as server:
        with pytest.raises(redis.AuthenticationError):
            connect(server.url).ping()
        assert connect(server.url.replace("redis://", "redis://:from-a-file@")).ping()
        (tmp_path / "secret").write_text("from-a-file\n")
        monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "secret"))
        assert connect(server.url).ping()
        monkeypatch.setenv(PASSWORD_ENV, "wrong")  # the variable wins over the file
        with pytest.raises(redis.AuthenticationError):
            connect(server.url).ping()


def test_a_restart_is_seen_even_by_a_client_that_made_no_call_meanwhile(tmp_path):
    """redis-py reconnects a pooled connection whose server went away without raising, so
    only the server's run_id tells a process that was busy elsewhere that Redis restarted."""
    with EmbeddedRedis(tmp_path) as server:
        client = connect(server.url, wait_s=30)
        watch = RestartWatch(client)
        assert not watch.restarted()
        server.kill()
        server.start()
        assert client.ping() and outages(client) == 0  # no call failed...
        assert watch.restarted() and not watch.restarted()  # ...but the restart is seen, once
