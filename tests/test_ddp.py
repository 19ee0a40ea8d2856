"""The learner under torchrun: 2 CPU ranks (FSDP2 or DDP over gloo) take the same steps as 1 process.

Both runs read the same groups from their own stream and train 2 steps; the weights in
their final checkpoints and the step metrics must agree to float tolerance (the gradient
all-reduce or reduce-scatter only changes the order of float additions).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from learner import checkpoint
from learner.metrics import read_jsonl
from learner.policy import load_policy
from rlpipe.config import build_config, dump_config
from rlpipe.queue import TrajectoryQueue
from rlpipe.redis_link import connect
from tests.conftest import free_run_id
from tests.families import save_tiny_model
from tests.test_learner import for_run, synthetic_groups


def prepared_run(tmp_path, name, redis_server, toy_model_path, groups, **settings):
    run_dir = tmp_path / name
    run_dir.mkdir()
    cfg = build_config({}, environ={}, run_id=free_run_id(name), run_dir=str(run_dir), redis_url=redis_server.url,
                       workers=1, seed=3, **{
                           "steps": 2, "model.path": toy_model_path, "learner.groups_per_step": 4, "learner.minibatches": 2,
                           "learner.lr": 1e-3, "learner.threads": 1, "learner.checkpoint_every": 2,
                           "learner.loss_agg": "seq_mean_token_mean", "sync.join_timeout_s": 0.1, "sampling.n": 4,
                           # Ranks and one process sum in different orders; rounding to the served bf16 would
                           # turn a weight's last-bit difference into a whole bf16 step (0.4%) now and then.
                           "learner.served_weights": False, **settings})
    dump_config(cfg, run_dir / "config.yaml")
    queue = TrajectoryQueue(connect(cfg.redis_url), cfg.run_id)
    for rec in for_run(groups, cfg):
        queue.push(rec)
    return cfg, run_dir


# LoRA (learner.lora, with its KL reference: the policy with the adapter off, whose forwards
# under FSDP are collectives too) rides on the padded FSDP case
LORA = {"learner.lora.rank": 8, "learner.kl_coef": 0.05}
MOE = {"family": "qwen3_moe"}  # the fsdp-moe case: a tiny random Qwen3-MoE instead of the toy


@pytest.mark.slow
# the FSDP micro-batch case trains a mixture of experts (tests/test_fsdp.py shards the dense toy)
@pytest.mark.parametrize(("parallel", "microbatch_tokens", "lora"), [("ddp", 20, {}), ("fsdp", 0, LORA),
                                                                     ("fsdp", 20, MOE)],
                         ids=["ddp-token-budget-microbatches", "fsdp-padded-lora",
                              "fsdp-moe-token-budget-microbatches"])
def test_two_gloo_ranks_take_the_same_steps_as_one_process(redis_server, toy_model_path, tmp_path, parallel,
                                                           microbatch_tokens, lora):
    """With micro-batches, the 2 ranks also accumulate gradients without syncing until each
    one's last micro-batch (DDP no_sync, FSDP set_requires_gradient_sync), run as many
    forwards as each other under FSDP (padded with weightless ones), and must still match
    the single padded process; a LoRA adapter too (its checkpoint holds the adapter alone),
    and a mixture of experts (each MoE block sharded as a unit of its own)."""
    moe = lora is MOE  # its checkpoint has one tensor per expert, as its model directory does
    if moe:
        toy_model_path, lora = save_tiny_model("qwen3_moe", tmp_path / "moe"), {}
    groups = synthetic_groups(load_policy(toy_model_path), 8, seed=21, noise=0.1)
    single, single_dir = prepared_run(tmp_path, "single", redis_server, toy_model_path, groups, **lora)
    ddp, ddp_dir = prepared_run(tmp_path, "ddp", redis_server, toy_model_path, groups,
                                **{"learner.max_tokens_per_microbatch": microbatch_tokens,
                                   "learner.parallel": parallel, **lora})
    learner = [sys.executable, "-m", "launch.cli", "learner", "--config"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*learner, str(single_dir / "config.yaml")], check=True, env=env, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *learner[1:], str(ddp_dir / "config.yaml")], env=env, timeout=300, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]

    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    a = load_file(checkpoint.latest(single_dir / "checkpoints") / weights)
    b = load_file(checkpoint.latest(ddp_dir / "checkpoints") / weights)
    # an adapter starts with B = 0 (A is the seed's, alike in both runs): what B holds is how far it moved
    base = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in a.items()} if lora \
        else load_file(f"{toy_model_path}/model.safetensors") if moe else load_policy(toy_model_path).state_dict()
    a, b = ({k: v for k, v in t.items() if ".lora_B." in k} if lora else t for t in (a, b))
    # Norm-wise, over every trained tensor: AdamW's first steps move each weight by about lr * sign(g),
    # so a weight whose gradient is near zero moves either way on reduction-order noise alone (the
    # ranks sum in another order, and that order differs between AVX2 and AVX-512 CPUs); its
    # elementwise difference is then as large as the largest move, while the norm of all the
    # differences stays a small part of the norm of all the moves. A rank that trained on other
    # rows, or did not average its gradients, differs by a large part of it.
    moved = sum(((a[k] - base[k]).double() ** 2).sum().item() for k in a) ** 0.5
    diff = sum(((a[k] - b[k]).double() ** 2).sum().item() for k in a) ** 0.5
    assert max((a[k] - base[k]).abs().max().item() for k in a) > 1e-3, "the steps did not train"
    print(f"weight change (norm) {moved:.3e}, difference between runs (norm) {diff:.3e}")
    assert diff < 1e-2 * moved, f"ranks disagree with the single process by {diff} (norm; moved {moved})"
    ma, mb = read_jsonl(single_dir / "metrics.jsonl"), read_jsonl(ddp_dir / "metrics.jsonl")
    assert len(ma) == len(mb) == 2 and [m["learner_ranks"] for m in ma + mb] == [1, 1, 2, 2]
    assert [m["learner_parallel"] for m in ma + mb] == ["none", "none", parallel, parallel]
    for key in ("mismatch_kl", "mismatch_log_ppl_abs_diff", "learner_loss", "learner_grad_norm", "entropy"):
        for x, y in zip(ma, mb):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    assert torch.isfinite(torch.tensor([m["learner_loss"] for m in mb])).all()
    if moe:  # each run's routers counted their load (rank 0's rows under FSDP)
        assert all(1 <= m["router_load_max"] <= 2 and m["router_aux_loss"] > 0 for m in ma + mb)
