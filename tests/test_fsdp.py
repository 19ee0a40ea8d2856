"""The sharded learner (``learner.parallel: fsdp``, 2 gloo ranks under torchrun) beyond
taking the same steps as one process (tests/test_ddp.py):

- a checkpoint saved by the sharded ranks resumes in one process, and one saved by one
  process resumes on the sharded ranks, and the ranks resume their own; every way the weights after 4 steps are those
  of 4 steps in one process (so the Adam moments, saved keyed by parameter name, came
  back where they belong), with the optimizer state gathered whole on rank 0
  (``checkpoint_format: full``) or written by each rank as its own shard (``auto``: DCP
  under FSDP, whole in one process, so both directions cross formats);
- the weight sync of a sharded model gathers one bucket at a time: rank 0's resident
  memory rises by a few buckets during the sync, far less than gathering the model, and
  the worker receives exactly the whole model;
- one rank SIGKILLed in a live run (separate worker processes, Redis): the learner job
  ends at once instead of hanging in a collective, its restart resumes from the last
  checkpoint, and the pipeline is back at its steady state with nothing lost or trained twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from launch.cluster import Cluster, audited, back_to_steady, segments, steady
from learner import checkpoint
from learner.policy import load_policy
from tests.conftest import ROOT, free_run_id
from tests.test_ddp import prepared_run
from tests.test_learner import synthetic_groups
from tests.test_weight_sync import start_receivers, stop

pytestmark = pytest.mark.slow
LEARNER = [sys.executable, "-m", "launch.cli", "learner", "--config"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# For a peak of resident memory that is what a rank holds: glibc serves every allocation of
# 64 KiB or more from its own mapping, returned on free, rather than from a heap whose freed
# holes stay resident (its default threshold grows with the sizes freed, so a run's peak
# would depend on the order of its allocations: CI saw 3x this machine's).
MEASURED_ENV = {**ENV, "MALLOC_MMAP_THRESHOLD_": "65536"}


def train(run_dir, ranks: int, steps: int):
    """Run the learner of ``run_dir`` (1 process or 2 FSDP ranks) until ``steps``."""
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(cfg_path.read_text().replace("steps: 2\n", f"steps: {steps}\n", 1))
    cmd = [*LEARNER, str(cfg_path)] if ranks == 1 else [*TORCHRUN, *LEARNER[1:], str(cfg_path)]
    out = subprocess.run(cmd, env=ENV, timeout=300, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]


def final_weights(run_dir):
    path = checkpoint.latest(run_dir / "checkpoints")
    assert checkpoint.read_meta(path)["trained_groups"] == 16
    return load_file(path / "model.safetensors")


def optimizer_format(run_dir) -> str:
    """How the newest checkpoint of ``run_dir`` holds the optimizer state: sharded (a DCP
    directory, nothing in trainer_state.pt) or full."""
    path = checkpoint.latest(run_dir / "checkpoints")
    sharded = (path / checkpoint.SHARDS / ".metadata").is_file()
    assert sharded != ("optimizer" in checkpoint.load_state(path)), path
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), "a temporary directory was left behind"
    return "sharded" if sharded else "full"


# "auto" (sharded on several ranks) is a soak case: minutes on CI, and "full" crosses the same loads
@pytest.mark.parametrize("checkpoint_format", ["full", pytest.param("auto", marks=pytest.mark.soak)])
def test_checkpoints_cross_load_between_fsdp_ranks_and_one_process(redis_server, toy_model_path, tmp_path,
                                                                   checkpoint_format):
    groups = synthetic_groups(load_policy(toy_model_path), 16, seed=5, noise=0.1)
    settings = {"learner.parallel": "fsdp", "learner.checkpoint_every": 1, "queue.max_staleness": 100,
                "learner.checkpoint_format": checkpoint_format}
    # (FSDP resuming from its own checkpoint is the killed-rank test's restart; here, across the two)
    runs = {name: prepared_run(tmp_path, name, redis_server, toy_model_path, groups, **settings)[1]
            for name in ("straight", "fsdp_then_one", "one_then_fsdp")}
    fsdp_format = "full" if checkpoint_format == "full" else "sharded"
    train(runs["straight"], 1, 4)
    train(runs["fsdp_then_one"], 2, 2)
    assert optimizer_format(runs["fsdp_then_one"]) == fsdp_format
    train(runs["fsdp_then_one"], 1, 4)
    assert optimizer_format(runs["fsdp_then_one"]) == "full"
    train(runs["one_then_fsdp"], 1, 2)
    assert optimizer_format(runs["one_then_fsdp"]) == "full"
    train(runs["one_then_fsdp"], 2, 4)
    assert optimizer_format(runs["one_then_fsdp"]) == fsdp_format
    straight = final_weights(runs["straight"])
    base = load_policy(toy_model_path).state_dict()
    moved = max((straight[k] - base[k]).abs().max().item() for k in straight)
    assert moved > 1e-3, "the steps did not train"
    for name in ("fsdp_then_one", "one_then_fsdp"):
        got = final_weights(runs[name])
        diff = max((got[k] - straight[k]).abs().max().item() for k in straight)
        print(f"{name}: max difference from 4 steps in one process {diff:.2e} (moved {moved:.2e})")
        assert diff < 1e-2 * moved, (name, diff, moved)


def test_sync_from_sharded_ranks_gathers_one_bucket_at_a_time(redis_server, tmp_path):
    run_id = free_run_id("fsdp-sync")
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok"})
    out = tmp_path / "sync.json"
    try:
        run = subprocess.run([*TORCHRUN, str(ROOT / "tests" / "fsdp_sync_rank.py"), redis_server.url, run_id,
                              str(out)], env=MEASURED_ENV, timeout=300, capture_output=True, text=True, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(out.read_text())
        assert results.get(timeout=60) == ("w0", got["checksum"], 1)  # the whole model, bit for bit
    finally:
        stop(procs)
    print(got)
    assert got["members"] == 1 and got["buckets"] >= 10
    sync_peak, whole_peak = got["sync_peak_kib"] * 1024, got["whole_gather_peak_kib"] * 1024
    # The whole model gathered at once costs most of its size (the allocator reuses some memory
    # the sync freed); the streamed sync a few buckets whatever the model's size: two packing
    # buffers, one bucket's parameters gathered in fp32, and the gather's own buffers.
    assert whole_peak > got["model_bytes"] / 2, got
    assert sync_peak < 10 * got["bucket_bytes"], got
    assert sync_peak < whole_peak / 4, got


# soak: minutes on CI; test_fsdp's sharded sync and test_quant's int8 cover each half in the suite
@pytest.mark.soak
def test_int8_from_sharded_ranks_is_the_whole_models_quantization_bit_for_bit(redis_server, tmp_path):
    """Item 6 of the GPU-cluster issue: the learner's int8 channel under FSDP plans its
    manifest from shapes, quantizes each bucket as it is gathered and monitors a layer
    sample through a forward both ranks run; the worker gets exactly what quantizing the
    whole model in one process gives, and rank 0 never holds the whole model."""
    run_id = free_run_id("fsdp-int8")
    procs, results = start_receivers(redis_server, run_id, {"w0": "ok"})
    out = tmp_path / "sync.json"
    try:
        run = subprocess.run([*TORCHRUN, str(ROOT / "tests" / "fsdp_sync_rank.py"), redis_server.url, run_id,
                              str(out), "int8", str(tmp_path / "model")], env=MEASURED_ENV, timeout=300, capture_output=True,
                             text=True, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(out.read_text())
        assert results.get(timeout=60) == ("w0", got["checksum"], 1)  # int8, scales and the rest, bit for bit
    finally:
        stop(procs)
    m = got["metrics"]
    print({k: v for k, v in got.items() if k != "metrics"}, m)
    # The monitors hold one sampled layer at a time (a 32nd of the model, in fp32 with its
    # smoothed copy and the layer FSDP gathers for the probe forward); each int8 bucket is
    # made from 4x its size in gathered fp32 weights. About 30 MB, of a 136 MB model.
    assert got["whole_gather_peak_kib"] * 1024 > got["model_bytes"] * 0.9, got
    assert got["members"] == 1 and got["sync_peak_kib"] < got["whole_gather_peak_kib"] / 3, got
    assert m["quant_monitor_layers"] == [0, 16, 31]  # the first, a middle and the last of 32 layers
    assert "quant_kl_vs_bf16" not in m and m["quant_seconds"] > 0
    # the made-up static input scales clip the random model's activations: the monitors saw them
    assert m["quant_act_clip_fraction"] > 0 and m["quant_worst"]["quant_act_clip_fraction"]["linear"].startswith(
        ("model.layers.0.", "model.layers.16.", "model.layers.31."))


# soak: minutes on CI; test_multinode's lost node covers a rank's death ending the job and its resume
@pytest.mark.soak
def test_a_killed_rank_ends_the_learner_and_its_restart_returns_to_steady_state(tmp_path, toy_model_path):
    from launch.cluster import SETTINGS, SETTLE

    settings = {**SETTINGS, "steps": 16, "learner.ranks": 2, "learner.parallel": "fsdp"}
    cluster = Cluster(tmp_path, toy_model_path, workers=2, **settings)
    with audited(cluster) as books:
        for w in ("w0", "w1"):
            cluster.start_worker(w, wait=False)
        cluster.start_learner()
        cluster.wait_step(7)
        cluster.kill_learner_rank(1)
        assert cluster.learner.wait(timeout=90) != 0  # the job ends; a supervisor restarts it
        cluster.start_learner()
        cluster.wait_done()
        cluster.check_alive(learner_may_exit=True)
    parts = segments(cluster.metrics())
    assert len(parts) == 2 and {r["learner_parallel"] for p in parts for r in p} == {"fsdp"}, parts
    before, after = steady([r for r in parts[0] if r["step"] > SETTLE]), steady(parts[1][SETTLE:])
    print({"before": before, "after": after, "books": books})
    assert back_to_steady(before, after, settings["queue.max_lag"]), (before, after)
    assert parts[-1][-1]["step"] == settings["steps"]
    assert books["lost"] == 0 and books["trained_twice"] == 0, books


def test_a_sharded_checkpoint_never_holds_the_whole_adam_state_on_rank_0(tmp_path):
    """bench/checkpoint_memory.py on 2 FSDP ranks (a 70 MB random Qwen2, 140 MB of Adam
    state): with the full format rank 0 holds the whole Adam state for the write, with the
    sharded one only its half, and its resident memory rises less; the weights saved agree."""
    out = tmp_path / "mem.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "checkpoint_memory.py"), "--out", str(out)], env=ENV,
                         timeout=300, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout)
    full, sharded = (json.loads(out.read_text())["arms"][f] for f in ("full", "sharded"))
    adam = full["optimizer_bytes"]
    assert full["held_optimizer_bytes"] >= adam
    assert sharded["held_optimizer_bytes"] < 0.51 * adam
    assert full["held_weights_bytes"] == sharded["held_weights_bytes"] == full["model_bytes"]
    assert sharded["peak_rise_kib"] * 1024 < full["peak_rise_kib"] * 1024 - adam / 4
