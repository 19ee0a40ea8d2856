"""The embedded Redis: starts on a free loopback port with AOF on, persists, stops."""

from __future__ import annotations

import redis

from rlpipe.redis_server import EmbeddedRedis


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
