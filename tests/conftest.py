"""Shared fixtures: one real Redis, the toy model, and one real rollout worker per session.

The worker is a separate ``rlpipe rollout`` process (real vLLM engine in fp32, real
FastAPI over HTTP, real Redis stream, real gloo weight sync). Tests act as the learner:
they push weights with the production ``WeightSender`` and read the groups the worker
produces. Back-pressure (``groups_per_step=1``, ``max_lag=0``) makes the worker produce
exactly one group per learner version, so each test sees groups of a known version.
Also here: a real HTTP reward server (``verifier``) for the remote-verifier tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from launch.cluster import free_run_id, launch_worker, stop_worker, wait_for  # the tests import them from here too
from launch.redis_server import EmbeddedRedis
from launch.toy import TOY_SPEC, ensure_toy_model
from rlpipe.config import build_config, dump_config
from rlpipe.keys import Keys
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import connect
from rlpipe.registry import set_learner_state, worker_incarnations

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def r(redis_server):
    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def toy_model_path() -> str:
    return str(ensure_toy_model(TOY_SPEC, log=lambda m: None))


@pytest.fixture(scope="session")
def real_model_path() -> str:
    """The built-in SmolLM2 (launch/builtin_models.py), converted once from its installed
    package and then cached: a test that needs its tokenizer runs on a fresh clone too."""
    from launch.builtin_models import ensure_builtin_model
    from rlpipe.paths import SMOLLM2

    return str(ensure_builtin_model(SMOLLM2, log=lambda m: None))


def interruptible() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: SIGINT back to its default. A test run
    started in the background without job control (``cmd &`` in a script, nohup) ignores
    SIGINT, every child inherits that, and Python then installs no KeyboardInterrupt
    handler: the test's SIGINT would never reach the demo (it failed so in a CI run)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


class WorkerHarness:
    """A running rollout worker plus the learner-side tools to drive it."""

    def __init__(self, cfg, proc, address, r):
        from quant.transfer import rollout_weights
        from weight_sync.sender import WeightSender

        self.cfg, self.proc, self.address, self.r = cfg, proc, address, r
        self.keys = Keys(cfg.run_id)
        self.queue = TrajectoryQueue(r, cfg.run_id)
        self.queue.ensure_consumer_group()
        self.http = httpx.Client(base_url=f"http://{address}", timeout=60)
        self.version = -1
        # What the learner would send workers of this precision (cast, or quantized with the profile).
        self.wire = rollout_weights(cfg.rollout.precision, cfg.quant, cfg.model.path, lora=bool(cfg.learner.lora.rank))
        self.sent: dict[str, torch.Tensor] = {}  # the tensors of the last sync
        # as learner/channels.py makes it: quantized wires send deltas after a generation's first version
        self.sender = WeightSender(r, self.keys, "127.0.0.1", timeout_s=30, bucket_bytes=1 << 20,
                                   wire_dtype=self.wire.cast_to,
                                   full_every=cfg.sync.delta_full_every if self.wire.quantized else 0)
        self.stats = None  # the last sync's SyncStats

    def sync(self, model) -> int:
        """Broadcast ``model``'s weights as the next version and let the worker produce for it."""
        self.version += 1
        self.sent, _ = self.wire.prepare(model, self.version)
        stats = self.stats = self.sender.sync(self.version, self.sent.items, worker_incarnations(self.r, self.keys),
                                              self.wire.quant_profile, self.wire.compat, self.wire.adapter)
        assert stats.members == 1
        # the harness consumes one step's groups per version, as a learner would
        set_learner_state(self.r, self.keys, version=self.version, step=self.version, status="running",
                          consumed=self.version * self.cfg.learner.groups_per_step)
        def arrived():
            status = self.http.get("/v1/status").json()
            return status["synced"] and status["version"] == self.version

        wait_for(arrived, 60, what=f"version {self.version} on the worker")
        return self.version

    def next_group(self, version: int, timeout: float = 60):
        """The next group generated with ``version`` (older ones are skipped); acknowledged."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for entry in self.queue.read("tests", 1, block_ms=500):
                self.queue.ack([entry.entry_id])
                if entry.record.policy_version >= version:
                    return entry.record
        raise TimeoutError(f"no group of version {version} from the worker")


def start_worker(redis_url: str, model_path: str, run_dir: Path, worker_id: str = "w0", **overrides):
    """Start ``rlpipe rollout`` as its own process; returns (config, process, address)."""
    settings = {"model.path": model_path, "rollout.precision": "fp32", "learner.groups_per_step": 1,
                "queue.max_lag": 0, "rollout.max_inflight_groups": 4, **overrides}
    cfg = build_config({}, environ={}, run_id=free_run_id("w"), run_dir=str(run_dir), redis_url=redis_url, **settings)
    cfg_path = run_dir / "config.yaml"
    dump_config(cfg, cfg_path)
    proc, address = launch_worker(cfg, cfg_path, worker_id)
    return cfg, proc, address


@contextlib.contextmanager
def standalone_worker(cfg, run_dir: Path, worker_id: str, token: str):
    """A worker of ``cfg`` without Redis (a plain API server) whose API needs ``token``,
    started, ready and warmed (a fresh engine's first generation builds its kernels: on a
    slow 2-core CI machine longer than httpx's 5 s default); yields its base URL, and at
    the end checks that nothing a client sent crashed it."""
    dump_config(cfg, run_dir / "config.yaml")
    address_file = run_dir / "address"
    env = {**os.environ, "RLPIPE_API_TOKEN": token, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(run_dir / "worker.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "rollout", "--config", str(run_dir / "config.yaml"),
                                 "--worker-id", worker_id, "--address-file", str(address_file)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ready():
        if proc.poll() is not None:
            raise RuntimeError((run_dir / "worker.log").read_text()[-3000:])
        try:
            return address_file.exists() and httpx.get(f"http://{address_file.read_text()}/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 300, interval=0.5, what="standalone worker start-up")
        base = f"http://{address_file.read_text()}"
        warm = httpx.post(f"{base}/v1/generate", json={"prompt": "1+1=", "max_tokens": 2},
                          headers={"Authorization": f"Bearer {token}"}, timeout=300)
        assert warm.status_code == 200, warm.text
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in (run_dir / "worker.log").read_text()


@pytest.fixture(scope="session")
def worker(redis_server, toy_model_path, tmp_path_factory):
    cfg, proc, address = start_worker(redis_server.url, toy_model_path, tmp_path_factory.mktemp("worker-run"))
    harness = WorkerHarness(cfg, proc, address, connect(redis_server.url))
    yield harness
    harness.sender.drop()
    stop_worker(proc)


def learner_logprobs(model, prompt_tokens, response_tokens, temperature: float = 1.0) -> torch.Tensor:
    """The learner's log-probs of a response, via the production code path (learner/synthetic_groups.py's,
    which the synthetic groups' mu comes from)."""
    from learner.synthetic_groups import own_logprobs

    return own_logprobs(model, prompt_tokens, response_tokens, temperature)


def max_diff(model, rec) -> float:
    """The largest difference between a group's behavior log-probs and the learner's recompute."""
    return max(float((learner_logprobs(model, rec.prompt_tokens, s.tokens) - torch.from_numpy(s.logprobs)).abs().max())
               for s in rec.samples)


class VerifierHandler(BaseHTTPRequestHandler):
    """Scores each response by its length; ``server.plan`` lists how to misbehave on the next requests."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((dict(self.headers), body))
        mode = self.server.plan.pop(0) if self.server.plan else "ok"
        n = len(body["responses"])
        if mode == "sleep":
            time.sleep(0.6)
        status, payload = {
            "503": (503, {"error": "busy"}),
            "429": (429, {"error": "slow down"}),
            "400": (400, {"error": "bad request"}),
            "badjson": (200, "{not json"),
            "short": (200, {"rewards": [1.0] * (n - 1)}),
            "nan": (200, {"rewards": [float("nan")] * n}),
            "str": (200, {"rewards": ["1"] * n}),
            "nested": (200, {"rewards": [1.0] * n, "infos": [{"a": [1]}] * n}),
        }.get(mode, (200, {"rewards": [float(len(r)) for r in body["responses"]],
                           "infos": [{"len": len(r)} if i % 2 else None for i, r in enumerate(body["responses"])]}))
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client timed out and left
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def verifier():
    server = ThreadingHTTPServer(("127.0.0.1", 0), VerifierHandler)
    server.plan, server.seen = [], []
    server.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
