"""``rlpipe demo --learner-ranks 2`` on the toy Llama (untied LM head, GQA): the learner runs
as torchrun's 2 ranks, trains, and its rank 0 syncs an int8 worker (each update quantized
bucket by bucket as the shards are gathered, monitored on a layer sample);
Ctrl-C stops every rank gracefully (torchrun forwards the SIGTERM) and leaves no process
behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.metrics import read_jsonl
from rlpipe.checkpoints import PREFIX, latest
from rlpipe.config import build_config, load_config
from rlpipe.keys import Keys
from rlpipe.redis_link import connect
from rlpipe.registry import live_workers
from tests.conftest import interruptible, wait_for
from tests.test_demo import processes_of_run

PARALLEL = "fsdp"  # the ranks' learner.parallel: the default with more than one rank (auto)


def test_learner_ranks_is_one_key_that_turns_the_learner_into_torchrun():
    from launch.cli import _overrides, _parser
    from launch.launcher import torchrun_command

    for command in ("demo", "up"):
        assert _overrides(_parser().parse_args([command, "--learner-ranks", "3"]))["learner.ranks"] == 3
    cmd, env = torchrun_command(build_config({}, environ={}, **{"learner.ranks": 2}), ["learner", "--config", "r.yaml"])
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "launch.cli", "learner", "--config", "r.yaml"]
    assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))  # each rank its share
    _, env = torchrun_command(build_config({}, environ={}, **{"learner.ranks": 2, "learner.threads": 3}), [])
    assert env["OMP_NUM_THREADS"] == "3"


# soak: a whole two-rank demo; test_ddp, test_fsdp and test_demo cover its parts in the suite
@pytest.mark.soak
@pytest.mark.slow
def test_two_learner_ranks_train_the_toy_llama_sync_an_int8_worker_and_stop_cleanly(tmp_path):
    # int8 covers what a bf16 worker would here, and more: the sharded bf16 sync has tests/test_fsdp.py
    precision = "int8"
    run_dir = tmp_path / "ranks"
    log_path = tmp_path / "demo.log"
    log = open(log_path, "wb")
    demo = subprocess.Popen([sys.executable, "-m", "launch.cli", "demo", "--learner-ranks", "2", "--workers", "1",
                             "--precision", precision, "--steps", "200", "--run-id", "ranks", "--runs-dir", str(tmp_path),
                             "--set", "model.path=toy-llama", "--set", f"learner.parallel={PARALLEL}",
                             "--set", "learner.groups_per_step=8"], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=interruptible)
    try:
        wait_for(lambda: demo.poll() is not None or len(read_jsonl(run_dir / "metrics.jsonl")) >= 3, 420,
                 interval=0.5, what="3 learner steps")
        assert demo.poll() is None, log_path.read_text(errors="replace")[-3000:]
        cfg = load_config(run_dir / "config.yaml", environ={})
        assert (cfg.learner.ranks, cfg.learner.parallel) == (2, PARALLEL)
        model = json.loads((Path(cfg.model.path) / "config.json").read_text())
        assert model["architectures"] == ["LlamaForCausalLM"] and not model["tie_word_embeddings"]
        assert model["num_key_value_heads"] < model["num_attention_heads"]

        # The learner role is torchrun and its 2 ranks, each with its share of the cores.
        env = {p.pid: p.environ() for p in processes_of_run(demo.pid, run_dir)}
        ranks = {e["RANK"]: e["OMP_NUM_THREADS"] for e in env.values() if "TORCHELASTIC_RUN_ID" in e}
        share = str(max(1, len(os.sched_getaffinity(0)) // 2))
        assert ranks == {"0": share, "1": share}, ranks

        # The worker runs the versions the 2-rank learner sends it.
        r, keys = connect(cfg.redis_url), Keys(cfg.run_id)
        wait_for(lambda: int(live_workers(r, keys).get("w0", {}).get("version", -1)) >= 2, 120, interval=0.5,
                 what="the worker on version 2")

        before_stop = len(read_jsonl(run_dir / "metrics.jsonl"))
        demo.send_signal(signal.SIGINT)
        demo.wait(90)
        assert demo.returncode == 130, log_path.read_text(errors="replace")[-3000:]
        wait_for(lambda: not processes_of_run(demo.pid, run_dir), 45, interval=0.5, what="every process to exit")
    finally:
        if demo.poll() is None:
            demo.kill()
        for p in processes_of_run(demo.pid, run_dir):
            p.kill()
        log.close()

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) >= 3 and [m["learner_version"] for m in rows] == list(range(1, len(rows) + 1))
    assert all(m["learner_ranks"] == 2 for m in rows)
    # every version reached the worker (a step that ends after the Ctrl-C may find it gone)
    assert all(m["weight_sync_members"] == 1 for m in rows[:before_stop])
    assert all(m["learner_tokens_per_second"] > 0 for m in rows)
    # Both ranks got the SIGTERM through torchrun and stopped at a step boundary: rank 0
    # checkpointed its last step and acknowledged every group it trained (what it had read
    # towards the next step stays pending, for the next learner).
    learner_log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert "learner[rank 0] INFO learner.main: stop requested" in learner_log
    assert "learner[rank 1] INFO learner.main: stop requested" in learner_log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_trained"] == 8 * len(rows) and summary["groups_unacknowledged"] < 8
    assert int(latest(run_dir / "checkpoints").name[len(PREFIX):]) == len(rows)
    # Monitored on both layers of the toy; what returning workers load, checkpointed.
    assert all(m["quant_monitor_layers"] == [0, 1] and "quant_kl_vs_bf16" not in m for m in rows), rows[-1]
    assert all(m["quant_seconds"] > 0 and m["quant_act_clip_fraction"] >= 0 for m in rows)
    from safetensors.torch import load_file

    sent = load_file(latest(run_dir / "checkpoints") / "rollout" / "int8" / "model.safetensors")
    assert sent["model.layers.1.mlp.down_proj.weight"].dtype == torch.int8
    print(f"{len(rows)} steps on 2 ranks: {(rows[-1]['time'] - rows[0]['time']) / (len(rows) - 1):.2f} s/step "
          f"(training {sum(m['learner_step_seconds'] for m in rows) / len(rows):.2f} s), "
          f"{sum(m['learner_tokens_per_second'] for m in rows) / len(rows):.0f} learner tokens/s")
