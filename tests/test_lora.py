"""LoRA on a frozen base (learner.lora, issue 35): the learner's side, the adapter wire, and
what a worker accepts. The real engines run in tests/test_lora_engine.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from learner.lora import BaseView, served_weights, trainable
from quant.int8 import int8_tensors, served_base, smooth_groups, smoothed_adapter
from rlpipe.config import ConfigError, build_config
from tests.conftest import free_run_id
from tests.test_learner import base_model, for_run, synthetic_groups  # noqa: F401 (a fixture)
from weight_sync.adapters import adapter_incompatibility, read_adapter, wire_config, wire_tensors, write_adapter
from weight_sync.manifest import Manifest, incompatibility, plan_buckets
from weight_sync.names import checkpoint_shapes
from weight_sync.transport_choice import resolve_transport


def smoothing_for(params: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random smoothing vectors (0.5..8, the range real profiles show) for every group."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for group in smooth_groups(params):
        width = params[group.linears[0] + ".weight"].shape[1]
        out[group.norm] = 0.5 + 7.5 * torch.rand(width, generator=g)
    return out


def test_the_served_int8_base_is_the_dequantized_weights_with_the_smoothing_undone(base_model):
    params = {n: p.detach() for n, p in base_model.named_parameters()}
    smoothing = smoothing_for(params)
    tensors, smoothed = int8_tensors(params, smoothing, None)
    served = served_base(params, tensors, smoothing)
    linears = [g.linears for g in smooth_groups(params)]
    assert linears and set(served) == set(params)

    for group in smooth_groups(params):
        s = smoothing[group.norm]
        for lin in group.linears:
            w, got = params[lin + ".weight"], served[lin + ".weight"]
            # int8 rounds the smoothed weight by at most half its row's step; undone, (i, j)'s error is that / s_j,
            # and up_proj's rows, which carry 1 / s of down_proj's vector, times that
            step = smoothed[lin].abs().amax(1, keepdim=True) / 127
            rows = smoothing[lin][:, None] if lin.endswith("up_proj") else 1
            assert ((got - w).abs() <= 0.5 * step * rows / s[None, :] * 1.001 + 1e-6).all(), lin
            assert (got != w).any()  # it is the quantized weight, not the original
        if not group.norm.endswith("up_proj"):  # a norm: its bf16 rounding of norm / s, times s
            assert torch.allclose(served[group.norm + ".weight"], params[group.norm + ".weight"], rtol=2**-7)
    # not undoing the smoothing would be far off: the check above can fail
    q = linears[0][0] + ".weight"
    assert (tensors[q].float() * tensors[q.replace(".weight", ".weight_scale")] - params[q]).abs().max() > 0.1


def test_a_smoothed_adapter_on_the_smoothed_base_computes_the_raw_adapter_on_the_raw_base():
    """``A' = A s`` on what reads ``x / s``, and up_proj's ``B' = B / s_down``: the int8 engine's
    layer output with the rewritten adapter is the raw model's, exactly up to float rounding."""
    torch.manual_seed(0)
    hidden, inter, r = 16, 24, 4
    pre = "model.layers.0."
    params = {pre + "post_attention_layernorm.weight": torch.rand(hidden) + 0.5,
              pre + "mlp.up_proj.weight": torch.randn(inter, hidden),
              pre + "mlp.gate_proj.weight": torch.randn(inter, hidden),
              pre + "mlp.down_proj.weight": torch.randn(hidden, inter)}
    smoothing = smoothing_for(params)
    raw = {f"base_model.model.{pre}mlp.{m}.lora_{p}.weight": torch.randn(shape)
           for m, din, dout in (("up_proj", hidden, inter), ("down_proj", inter, hidden))
           for p, shape in (("A", (r, din)), ("B", (dout, r)))}
    adapted = smoothed_adapter(raw, smoothing, params)
    s_post, s_down = smoothing[pre + "post_attention_layernorm"], smoothing[pre + "mlp.up_proj"]
    x = torch.randn(3, hidden)

    def lora(t, m, x):
        key = f"base_model.model.{pre}mlp.{m}"
        return x @ t[f"{key}.lora_A.weight"].T @ t[f"{key}.lora_B.weight"].T

    up_raw = x @ params[pre + "mlp.up_proj.weight"].T + lora(raw, "up_proj", x)
    smoothed_w = params[pre + "mlp.up_proj.weight"] / s_down[:, None] * s_post[None, :]
    up_engine = (x / s_post) @ smoothed_w.T + lora(adapted, "up_proj", x / s_post)
    assert torch.allclose(up_engine, up_raw / s_down, rtol=1e-4, atol=1e-4)  # its rows carry 1 / s_down
    h = torch.randn(3, inter)
    down_raw = h @ params[pre + "mlp.down_proj.weight"].T + lora(raw, "down_proj", h)
    down_engine = (h / s_down) @ (params[pre + "mlp.down_proj.weight"] * s_down[None, :]).T + \
        lora(adapted, "down_proj", h / s_down)
    assert torch.allclose(down_engine, down_raw, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(lora(raw, "down_proj", h / s_down), lora(raw, "down_proj", h), atol=1e-3)


def lora_model(base_path: str, rank: int = 8, seed: int = 0):
    from learner.lora import wrap
    from learner.policy import load_policy

    model = wrap(load_policy(base_path), build_config({}, environ={}, **{"learner.lora.rank": rank}).learner.lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable(model):  # peft starts B at 0 (the base); a trained adapter is not
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def adapter_manifest(model, quant_profile: str = "", quant_compat: str = "") -> Manifest:
    tensors = wire_tensors(model)
    return plan_buckets([(n, torch.bfloat16, tuple(t.shape)) for n, t in tensors.items()], 1 << 20, quant_profile,
                        quant_compat, adapter=wire_config(model))


def test_a_worker_refuses_an_adapter_that_does_not_fit_its_engine_naming_why(toy_model_path):
    model = lora_model(toy_model_path)
    shapes = checkpoint_shapes(toy_model_path)
    ok = adapter_manifest(model)
    assert Manifest.from_json(ok.to_json()) == ok and json.loads(ok.adapter)["r"] == 8
    assert incompatibility(ok, shapes, lora_rank=8) is None
    assert "started for no adapters" in incompatibility(ok, shapes, lora_rank=0)
    assert "ranks up to 4" in adapter_incompatibility(ok, shapes, "", "gloo", "", 4)
    other = adapter_manifest(model, "aaaa1111", "int8-w8a8/dynamic/x")
    why = incompatibility(other, shapes, "int8-w8a8/dynamic/x", quant_profile="bbbb2222", lora_rank=8)
    assert "aaaa1111" in why and "bbbb2222" in why  # another profile: both named
    assert "unquantized" in incompatibility(other, shapes, "", lora_rank=8)
    wrong = {**shapes, "model.layers.0.self_attn.q_proj.weight": (7, 7)}
    assert "q_proj" in incompatibility(ok, wrong, lora_rank=8)
    missing = {n: s for n, s in shapes.items() if "v_proj" not in n}
    assert "v_proj" in incompatibility(ok, missing, lora_rank=8)


def test_an_adapter_version_written_for_vllm_reads_back_as_sent(toy_model_path, tmp_path):
    model = lora_model(toy_model_path)
    tensors = wire_tensors(model)
    path = write_adapter(list(tensors.items()), wire_config(model), 3, root=tmp_path)
    assert path.endswith("v3")
    back, config = read_adapter(path)
    assert config == wire_config(model) and all(torch.equal(tensors[n], t) for n, t in back)
    assert read_adapter(tmp_path) is None  # no adapter there


@pytest.fixture
def lora_learner(redis_server, toy_model_path, tmp_path):
    from learner.train import Learner

    def make(**overrides):
        cfg = build_config({}, environ={}, run_id=free_run_id("lora"), run_dir=str(tmp_path),
                           redis_url=redis_server.url,
                           **{"model.path": toy_model_path, "learner.groups_per_step": 4, "learner.lora.rank": 8,
                              "learner.lr": 1e-3, "rollout.precision": "bf16", **overrides})
        return Learner(cfg)

    return make


def test_a_lora_learner_trains_the_adapter_alone_on_the_base_as_served(lora_learner, base_model):
    learner = lora_learner(**{"learner.kl_coef": 0.1, "sampling.n": 4})
    n_adapter = sum(p.numel() for p in trainable(learner.model))
    held = [p for group in learner.opt.param_groups for p in group["params"]]
    assert sum(p.numel() for p in held) == n_adapter < 0.1 * sum(p.numel() for p in base_model.parameters())
    # the frozen base is the bf16 engine's: the fp32 weights rounded, once
    q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    base = dict(learner.model.named_parameters())[q]
    assert torch.equal(base, base_model.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16).float())
    assert isinstance(learner.ppo.reference, BaseView)  # the KL reference: the same weights, adapter off
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    records = for_run(synthetic_groups(base_model, 4, seed=3), learner.cfg)
    first = learner.ppo.train_step(records)
    assert first["kl_ref"] == pytest.approx(0, abs=1e-7)  # B = 0: the policy is the base
    second = learner.ppo.train_step(records)
    assert second["kl_ref"] > 1e-7
    moved = {n for n, p in learner.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved)  # the base never moves


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_it_exactly(lora_learner, base_model, tmp_path):
    learner = lora_learner()
    records = for_run(synthetic_groups(base_model, 4, seed=4), learner.cfg)
    learner.ppo.train_step(records)
    learner.run_counters.step = learner.run_counters.version = 1
    learner.ledger.unacked = []
    learner.checkpoint()
    learner._finish_checkpoint()
    path = learner.last_checkpoint["path"]
    files = {p.name for p in Path(path).iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin"}  # never the frozen base
    meta = json.loads((Path(path) / "meta.json").read_text())
    assert meta["base_model"] == learner.cfg.model.path
    resumed = lora_learner()
    assert resumed.step == 1
    for (n, a), (_, b) in zip(learner.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n
    state = resumed.opt.state_dict()["state"]
    # the adapter's moments only
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(p.numel() for p in trainable(resumed.model))


def test_the_served_base_follows_the_fleets_precision(toy_model_path, base_model):
    params = {n: p.detach() for n, p in base_model.named_parameters()}
    cfg = build_config({}, environ={}, **{"model.path": toy_model_path, "learner.lora.rank": 8})
    bf16 = served_weights(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"precision": "bf16"})}),
                          params)
    assert all(torch.equal(bf16[n], params[n].to(torch.bfloat16).float()) for n in params)
    fp32 = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"precision": "fp32"})})
    assert served_weights(fp32, params) is None  # the fp32 weights are what an fp32 engine serves


def test_a_checkpoints_adapter_is_staged_for_a_returning_worker_once_it_fits(toy_model_path, tmp_path):
    """What a restarted worker catches up from (rollout/<precision>/ of a LoRA checkpoint): the
    adapter, staged as a received one would be, and refused when its rank is not the engine's."""
    from learner import checkpoint
    from weight_sync.stager import WeightStager

    model = lora_model(toy_model_path)
    tensors = wire_tensors(model)
    path = checkpoint.save(tmp_path, 4, model, {}, {"version": 4},
                           rollout={"bf16": ("", tensors, wire_config(model))})
    rollout = path / "rollout" / "bf16"
    stager = WeightStager.for_model(toy_model_path, lora_rank=8)
    reply = stager.read(str(rollout))
    assert reply["ok"] and reply["adapter"] and stager.staged_adapter == wire_config(model)
    assert {n for n, _ in stager.take()} == set(tensors)
    small = WeightStager.for_model(toy_model_path, lora_rank=4).read(str(rollout))
    assert not small["ok"] and "rank-8 adapter" in small["error"] and str(rollout) in small["error"]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in path.iterdir()}


def test_the_grouped_cpu_lora_kernels_compute_what_vllms_per_token_ones_do():
    """rollout_service/vllm_compat.py ``grouped_cpu_lora``: one matmul per adapter in the batch
    gives vLLM's per-token einsum's sums, for one adapter, several, and slot -1 (as vLLM indexes it)."""
    import importlib

    from vllm.lora.ops.torch_ops import lora_ops

    original = importlib.reload(lora_ops)  # vLLM's own, whatever an engine in this process patched
    ops = {n: getattr(original, n) for n in ("bgmv_expand", "bgmv_shrink", "bgmv_expand_slice")}
    from rollout_service.vllm_compat import grouped_cpu_lora

    assert grouped_cpu_lora()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 1, 8, 32, generator=g)  # (slots, 1, rank, in)
    b = torch.randn(3, 1, 48, 8, generator=g)  # (slots, 1, out, rank)
    x = torch.randn(10, 32, generator=g)
    h = torch.randn(10, 8, generator=g)
    for indices in (torch.zeros(10, dtype=torch.long), torch.tensor([0, 1, 2, -1, 1, 0, 2, 2, -1, 0])):
        want, got = torch.zeros(10, 8), torch.zeros(10, 8)
        ops["bgmv_shrink"](x, a, want, indices, 0.5)
        lora_ops.bgmv_shrink(x, a, got, indices, 0.5)
        assert torch.allclose(got, want, atol=1e-5)
        want, got = torch.ones(10, 64), torch.ones(10, 64)
        ops["bgmv_expand_slice"](h, b, want, indices, 8, 48, True)
        lora_ops.bgmv_expand_slice(h, b, got, indices, 8, 48, True)
        assert torch.allclose(got, want, atol=1e-5)
        want, got = torch.ones(10, 48), torch.ones(10, 48)
        ops["bgmv_expand"](h, b, want, indices, True)
        lora_ops.bgmv_expand(h, b, got, indices, True)
        assert torch.allclose(got, want, atol=1e-5)
    # a bf16 engine's expand takes the shrink's fp32 sums: they are multiplied in fp32 and rounded once (a CPU
    # without native bf16 runs a bf16 matmul through torch's slow path); vLLM's own rounds them to bf16 first
    bb, one = b.bfloat16(), torch.zeros(10, dtype=torch.long)
    got = torch.zeros(10, 48, dtype=torch.bfloat16)
    lora_ops.bgmv_expand(h, bb, got, one, False)
    assert torch.equal(got, (h @ bb[0, 0].float().T).bfloat16())
    want = torch.zeros(10, 48, dtype=torch.bfloat16)
    ops["bgmv_expand"](h, bb, want, one, False)
    assert torch.allclose(got.float(), want.float(), rtol=5e-2, atol=5e-2) and not torch.equal(got, want)


def test_lora_refuses_at_launch_what_it_cannot_serve():
    from launch.checks import lora_problems

    cfg = build_config({}, environ={}, **{"learner.lora.rank": 8})
    assert lora_problems(cfg) == []
    mixed = build_config({}, environ={}, workers=2, **{"learner.lora.rank": 8, "rollout.fleet": ["bf16", "int8"]})
    assert "one precision" in lora_problems(mixed)[0]
    replay = build_config({}, environ={}, **{"learner.lora.rank": 8, "rollout.routing_replay": True})
    assert "routing_replay" in lora_problems(replay)[0]


def test_adapters_travel_over_gloo_on_a_gpu_node_and_nccl_or_ipc_is_refused_naming_why():
    """On GPUs ``sync.transport: auto`` is nccl or ipc for full versions; under learner.lora a
    version is an adapter, and every role must resolve gloo (the workers load it into a LoRA
    slot, which vLLM's transfer engines cannot write)."""
    from launch.gpus import plan_gpus

    lora = {"learner.lora.rank": 8}
    apart = {"learner.gpus": "0", "rollout.gpus": "1"}  # auto: nccl for a full fine-tune
    shared = {"learner.gpus": "0", "rollout.gpus": "0"}  # auto: ipc
    for gpus in (apart, shared):
        assert plan_gpus(build_config({}, environ={}, workers=1, **gpus), 2).transport != "gloo"
        assert plan_gpus(build_config({}, environ={}, workers=1, **gpus, **lora), 2).transport == "gloo"
    for transport in ("nccl", "ipc"):
        cfg = build_config({}, environ={}, workers=1, **apart, **lora, **{"sync.transport": transport})
        with pytest.raises(ConfigError, match=f"sync.transport: {transport} .* under learner.lora a version is its "
                                              f"adapter, which travels over gloo"):
            plan_gpus(cfg, 2)
    assert resolve_transport("auto", 8, adapters=True) == "gloo"  # a role resolving alone agrees


def test_a_lora_step_under_activation_checkpointing_is_the_plain_step(lora_learner, base_model):
    """Recomputing each decoder layer in the backward (learner.activation_checkpointing) gives
    the adapter the same update: the frozen base needs no gradient, the activations still do.
    (It also turns learner.share_prompt off: a recomputed layer extended the shared prompt's
    cache again, a shape error in the backward of every one-rank learner with both on.)"""
    records = for_run(synthetic_groups(base_model, 4, seed=7), lora_learner().cfg)
    moved = []
    for checkpointing in (False, True):
        learner = lora_learner(**{"learner.activation_checkpointing": checkpointing})
        before = [p.detach().clone() for p in trainable(learner.model)]
        learner.ppo.train_step([dataclasses.replace(r, run_id=learner.cfg.run_id) for r in records])
        moved.append([p.detach() - b for p, b in zip(trainable(learner.model), before)])
    assert max(float(d.abs().max()) for d in moved[0]) > 1e-5
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*moved))


def test_the_fused_decode_path_adds_what_vllms_per_slice_path_adds():
    """rollout_service/vllm_compat.py ``_fused_decode``: a decode batch of one adapter, every slice in
    one shrink and one expand, adds to the output what vLLM's per-slice path adds, decode or prefill; a
    batch of two adapters and tokens without one take vLLM's path; a new adapter version in the same
    tensors is seen."""
    from types import SimpleNamespace

    from rollout_service.vllm_compat import _fused_decode

    calls = []

    def per_slice(self, y, x, lora_a, lora_b, scale, slices, *, buffer=None, **kw):
        calls.append(1)
        off = 0
        for a, b, size in zip(lora_a, lora_b, slices):
            idx = self.token_lora_indices
            h = torch.stack([x[t].float() @ a[int(idx[t]), 0].float().T for t in range(len(x))]) * scale
            y[:, off:off + size] += torch.stack([h[t] @ b[int(idx[t]), 0].float().T for t in range(len(x))]).to(y.dtype)
            off += size

    fused = _fused_decode(per_slice)
    g = torch.Generator().manual_seed(0)
    lora_a = tuple(torch.randn(2, 1, 8, 32, generator=g) for _ in range(3))  # q, k, v: (slots, 1, rank, in)
    lora_b = tuple(torch.randn(2, 1, n, 8, generator=g) for n in (32, 16, 16))  # (slots, 1, out, rank)
    x = torch.randn(5, 32, generator=g)
    one = SimpleNamespace(is_prefill=False, token_lora_indices=torch.ones(5, dtype=torch.long))
    want, got = torch.ones(5, 64), torch.ones(5, 64)
    per_slice(one, want, x, lora_a, lora_b, 0.5, (32, 16, 16))
    calls.clear()
    fused(one, got, x, lora_a, lora_b, 0.5, (32, 16, 16))
    assert not calls and torch.allclose(got, want, atol=1e-4)
    with torch.no_grad():
        lora_b[1][1].mul_(2)  # a new version of the adapter, copied into the same slot
    want, got = torch.ones(5, 64), torch.ones(5, 64)
    per_slice(one, want, x, lora_a, lora_b, 0.5, (32, 16, 16))
    fused(one, got, x, lora_a, lora_b, 0.5, (32, 16, 16))
    assert torch.allclose(got, want, atol=1e-4)
    calls.clear()
    two = SimpleNamespace(is_prefill=False, token_lora_indices=torch.tensor([0, 1, 1, 0, 1]))
    fused(two, got, x, lora_a, lora_b, 0.5, (32, 16, 16))
    fused(SimpleNamespace(is_prefill=True, token_lora_indices=-torch.ones(5, dtype=torch.long)), got, x, lora_a,
          lora_b, 0.5, (32, 16, 16))
    assert len(calls) == 2  # vLLM's path for both
    want, got = torch.ones(5, 64), torch.ones(5, 64)  # a prefill batch of one adapter: fused too
    per_slice(one, want, x, lora_a, lora_b, 0.5, (32, 16, 16))
    fused(SimpleNamespace(is_prefill=True, token_lora_indices=one.token_lora_indices), got, x, lora_a, lora_b,
          0.5, (32, 16, 16))
    assert len(calls) == 3 and torch.allclose(got, want, atol=1e-4)
