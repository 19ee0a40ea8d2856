"""The architecture matrix: every decoder family users train, through the whole loop on a
real vLLM engine, and the launch check that the learner's tensors are the ones the engine
loads (a GPT-NeoX run was left out of every sync over ``lm_head.weight``, which its
checkpoint calls ``embed_out.weight``, and waited at step 0 forever)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch.checks import validate_run
from rlpipe.config import ConfigError, build_config
from rlpipe.redis_link import connect
from tests.conftest import WorkerHarness, max_diff, start_worker, stop_worker
from tests.families import FAMILIES, LAYERS, save_tiny_model, tiny_model
from weight_sync.names import checkpoint_shapes, served_mismatch, served_pieces


def test_served_names_are_the_checkpoints_for_every_family(tmp_path):
    """What the learner sends is named as ``save_pretrained`` names it, which is what vLLM loads."""
    renamed = {}
    for family in FAMILIES:
        path = save_tiny_model(family, tmp_path / family)
        model = tiny_model(family)
        pieces = served_pieces(model)
        assert set(pieces) <= set(checkpoint_shapes(path)), family
        assert served_mismatch(path) is None, family
        renamed.update({pc.param: n for n, pc in pieces.items() if pc.param != n and pc.view is None})
    # GPT-NeoX's head, and Mixtral's routers (its experts are per-expert views, not counted here): what
    # transformers 5 renames on saving
    assert renamed == {"lm_head.weight": "embed_out.weight",
                       **{f"model.layers.{i}.mlp.gate.weight": f"model.layers.{i}.block_sparse_moe.gate.weight"
                          for i in range(LAYERS)}}


def test_a_launch_names_the_first_tensor_the_workers_engine_would_not_load(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m")
    cfg = build_config({}, environ={}, **{"model.path": path})
    validate_run(cfg)  # as saved: fits
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["model.norm.scale"] = weights.pop("model.norm.weight")  # a checkpoint named otherwise
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model.path: .*'model.norm.weight'"):
        validate_run(cfg)
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        validate_run(cfg)


def grpo_step(model, record) -> int:
    """One GRPO step on the engine's group with the learner's loss terms; how many tensors moved."""
    from learner.batch import collate
    from learner.loss import compute_advantages, ppo_clip_terms
    from learner.policy import token_logprobs

    rewards = torch.tensor([[float(i % 2) for i in range(len(record.samples))]])
    advantages, _ = compute_advantages(rewards)
    batch = collate([record], advantages, 0)
    pi, _ = token_logprobs(model, batch)
    per_token, _ = ppo_clip_terms(pi, pi.detach(), batch.advantages, batch.mask, torch.ones_like(pi), 0.2, 0.2)
    per_token.sum().backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    return sum(not torch.equal(p, before[n]) for n, p in model.named_parameters())


# The families whose loading differs from the toys' Llama-style layers: Qwen3's q/k norms, Gemma's
# tied head, Phi-3's fused projections, GPT-NeoX's renamed head on vLLM's Transformers backend and
# Qwen3-MoE's fused experts (sent as per-expert views, on vLLM's CPU fused-MoE path).
# Llama, Qwen2 and Mistral load as the qwen2 and llama toys do, which the demo tests run end to end
# (Qwen2 and a Llama with GQA and its own head); RLPIPE_ALL_FAMILIES=1 runs them here too.
# Gemma's tied head runs in the suite; the others are soak cases, 45-50 s each, over the suite's budget:
# Qwen3 (q/k norms), Phi-3 (fused projections), GPT-NeoX (the renamed head), Qwen3-MoE (the fused experts,
# whose engine sync the suite checks end to end in tests/test_moe.py's routing-replay demo), Mixtral,
# OLMoE and Qwen2-MoE (three more MoE layouts on vLLM's CPU fused-MoE path, Qwen2-MoE's with a shared expert).
SOAK_FAMILIES = ("qwen3", "phi3", "gpt_neox", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
ENGINE_FAMILIES = list(FAMILIES) if os.environ.get("RLPIPE_ALL_FAMILIES") == "1" else \
    [pytest.param(f, marks=pytest.mark.soak) if f in SOAK_FAMILIES else f for f in ("gemma", *SOAK_FAMILIES)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_every_family_syncs_steps_and_recomputes_the_engines_logprobs(family, redis_server, tmp_path):
    """A worker serves the family's checkpoint; the learner syncs new weights, takes a GRPO
    step on the group it gets back, syncs again; each time the engine's log-probs equal the
    learner's fp32 recompute (a tensor left out or mis-named would differ by about 0.1). A
    mixture of experts takes its step with its routers installed and activation checkpointing on."""
    from learner import routing
    from learner.policy import enable_activation_checkpointing, load_policy

    path = save_tiny_model(family, tmp_path / "model")
    cfg, proc, address = start_worker(redis_server.url, path, tmp_path, **{"sampling.n": 4})
    worker = WorkerHarness(cfg, proc, address, connect(redis_server.url))
    try:
        model = load_policy(path)
        with torch.no_grad():  # weights the engine has not loaded
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        record = worker.next_group(worker.sync(model))
        gaps = [max_diff(model, record)]
        if routing.routing_shape(model) is not None:  # an MoE steps as a learner with checkpointing does
            routing.install(model)
            enable_activation_checkpointing(model)
        moved = grpo_step(model, record)
        gaps.append(max_diff(model, worker.next_group(worker.sync(model))))
        print(json.dumps({"family": family, "gaps": gaps, "tensors_moved": moved}))
        assert moved == len(list(model.parameters()))
        assert max(gaps) < 1e-4
    finally:
        worker.sender.drop()
        stop_worker(proc)
