"""A rollout worker whose engine dies does not linger as a zombie: it exits non-zero and
leaves the registry, so a supervisor (the launcher, Kubernetes) sees the failure."""

from __future__ import annotations

import psutil
import pytest

from rlpipe.keys import Keys
from rlpipe.redis_link import connect
from tests.conftest import start_worker, stop_worker, wait_for

pytestmark = pytest.mark.slow


def test_worker_exits_nonzero_when_its_engine_dies(redis_server, toy_model_path, tmp_path):
    cfg, proc, address = start_worker(redis_server.url, toy_model_path, tmp_path)
    try:
        names = {c.name(): c for c in psutil.Process(proc.pid).children(recursive=True)}
        assert "VLLM::EngineCore" in names
        assert "VLLM::Worker" not in names  # the model runs inside EngineCore: no busy-polling worker process
        names["VLLM::EngineCore"].kill()
        wait_for(lambda: proc.poll() is not None, 60, interval=0.2, what="the worker to exit")
        assert proc.returncode != 0
        assert "engine died" in (tmp_path / "worker.log").read_text()
        assert not connect(redis_server.url).exists(Keys(cfg.run_id).worker("w0"))
    finally:
        stop_worker(proc)
