"""INT8 calibration transfer without vLLM: the SmoothQuant fold, the profile artifact, the
per-update transfer against the calibrated checkpoint, and planted cases that must move
each monitor (quant/). Calibration runs nvidia-modelopt for real on the toy model."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file
from torch.func import functional_call

from launch.demo import calibration_sequences, resolve_quant_profile
from quant.calibrate import activation_amax, calibrate
from quant.int8 import (
    fp8_tensors,
    quant_config,
    quantized_linears,
    smooth_groups,
    smoothed_weights,
)
from quant.monitor import monitor, probe_batch
from quant.precision_profile import profile_for
from quant.quant_profile import ProfileError, QuantProfile, model_fingerprint
from quant.transfer import Int8Weights
from rlpipe.config import ConfigError, Int8Quant, QuantConfig, build_config


@pytest.fixture(scope="module")
def base(toy_model_path):
    from learner.policy import load_policy

    return load_policy(toy_model_path)


@pytest.fixture(scope="module")
def sequences(toy_model_path):
    cfg = build_config({}, environ={}, **{"model.path": toy_model_path, "quant.int8.calibration_samples": 96,
                                          "quant.int8.probe_samples": 32})
    return calibration_sequences(cfg, toy_model_path)


@pytest.fixture(scope="module", params=["static", "dynamic"])
def profile_dir(request, toy_model_path, tmp_path_factory):
    """``rlpipe calibrate`` as the CLI runs it, into a fresh directory."""
    cfg = build_config({}, environ={}, **{"model.path": toy_model_path, "quant.int8.activations": request.param,
                                          "quant.int8.calibration_samples": 96, "quant.int8.probe_samples": 32})
    out = tmp_path_factory.mktemp(f"profile-{request.param}")
    return resolve_quant_profile(cfg, toy_model_path, out, progress=False, log=lambda m: None)


def forward(model, params, ids, mask):
    return functional_call(model, params, (ids,), {"attention_mask": mask}).logits


def test_layer_groups_follow_the_decoder_layout(base):
    names = dict(base.named_parameters())
    assert len(quantized_linears(names)) == 7 * base.config.num_hidden_layers
    groups = {g.norm: g.linears for g in smooth_groups(names)}
    assert groups["model.layers.0.input_layernorm"] == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert groups["model.layers.1.post_attention_layernorm"] == ("model.layers.1.mlp.gate_proj",
                                                                 "model.layers.1.mlp.up_proj")
    assert groups["model.layers.1.mlp.up_proj"] == ("model.layers.1.mlp.down_proj",)
    assert not any(lin.endswith("o_proj") for linears in groups.values() for lin in linears)


def test_modelopt_activation_amax_is_the_per_channel_input_max(base, sequences):
    calib, _ = sequences
    amax = activation_amax(base, calib, alpha=0.5)
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in base.named_modules():
        if name in amax:
            def hook(m, args, name=name):
                x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
                seen[name] = torch.maximum(seen[name], x) if name in seen else x
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for s in calib:
            base(input_ids=torch.tensor([s]))
    for h in hooks:
        h.remove()
    assert set(amax) == set(quantized_linears(dict(base.named_parameters())))
    for name, a in amax.items():
        torch.testing.assert_close(a, seen[name], rtol=1e-5, atol=1e-5)  # batching differs
    # the policy itself is untouched (modelopt worked on a copy)
    assert all(type(m) is torch.nn.Linear for n, m in base.named_modules() if n in amax)


def test_smoothing_fold_preserves_the_function(base, sequences):
    calib, probe = sequences
    profile = calibrate(base, calib, probe, 0.5, "dynamic", "x")
    params = {n: p.detach() for n, p in base.named_parameters()}
    folded = {**params, **{k if k.endswith(".weight") else k + ".weight": v
                           for k, v in smoothed_weights(params, profile.smoothing).items()}}
    assert any(not torch.equal(folded[k], params[k]) for k in params)  # it did change the weights
    ids, mask = probe_batch(probe)
    torch.testing.assert_close(forward(base, folded, ids, mask), forward(base, params, ids, mask),
                               rtol=1e-4, atol=1e-4)
    # q/k/v share one vector folded into their norm, gate/up another; down_proj's is folded into up_proj's rows;
    # o_proj is not smoothed
    assert set(profile.smoothing) == {g.norm for g in smooth_groups(params)}
    assert "model.layers.0.mlp.up_proj" in profile.smoothing and "model.layers.0.self_attn.v_proj" not in profile.smoothing
    down = "model.layers.0.mlp.down_proj"
    assert not torch.equal(folded[down + ".weight"], params[down + ".weight"])


def test_transfer_reproduces_the_calibrated_checkpoint(base, profile_dir, toy_model_path):
    profile = QuantProfile.load(profile_dir)
    ckpt = load_file(f"{profile_dir}/checkpoint/model.safetensors")
    tensors, _ = profile.int8_tensors(dict(base.named_parameters()))
    assert set(tensors) == set(ckpt)
    for name, t in tensors.items():
        assert t.dtype == ckpt[name].dtype and torch.equal(t, ckpt[name]), name
    assert sum(t.dtype == torch.int8 for t in tensors.values()) == 14
    assert max(int(t.abs().max()) for t in tensors.values() if t.dtype == torch.int8) == profile.weight_max
    assert ("model.layers.0.self_attn.q_proj.input_scale" in ckpt) == profile.static
    config = json.loads(open(f"{profile_dir}/checkpoint/config.json").read())
    assert config["quantization_config"] == quant_config("int8", profile.static)
    assert profile.base_model == model_fingerprint(toy_model_path)
    assert profile.tools["nvidia-modelopt"] and profile.calibration_ids and profile.probe_ids


def test_profile_artifact_is_content_addressed(profile_dir, tmp_path):
    profile = QuantProfile.load(profile_dir)
    copy = tmp_path / "copy"
    profile.save(copy)
    assert QuantProfile.load(copy).hash == profile.hash
    profile.alpha = 0.8
    assert profile.hash != QuantProfile.load(profile_dir).hash
    meta = json.loads((copy / "profile.json").read_text())
    meta["input_scales"]["model.layers.0.self_attn.q_proj"] *= 2
    (copy / "profile.json").write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match="quant.int8.profile: .* corrupt"):
        QuantProfile.load(copy)
    with pytest.raises(ProfileError, match="quant.int8.profile: .* no profile.json"):
        QuantProfile.load(tmp_path / "nowhere")


def test_bad_quant_settings_name_the_field(profile_dir, toy_model_path, tmp_path):
    with pytest.raises(ConfigError, match="rollout.precision"):
        build_config({}, environ={}, **{"rollout.precision": "int4"})
    with pytest.raises(ProfileError, match="^quant.int8.profile: int8 rollout needs"):
        profile_for("int8", quant=QuantConfig(), model_path=toy_model_path)
    with pytest.raises(ProfileError, match="^quant.int8.profile: .* no profile.json"):
        profile_for("int8", quant=QuantConfig(int8=Int8Quant(profile=str(tmp_path / "missing"))), model_path=toy_model_path)
    profile = QuantProfile.load(profile_dir)
    other = {"static": "dynamic", "dynamic": "static"}[profile.activations]
    with pytest.raises(ProfileError, match="^quant.int8.activations"):
        profile_for("int8", quant=QuantConfig(int8=Int8Quant(profile=profile_dir, activations=other)), model_path=toy_model_path)
    # a profile made for another model: same architecture, other weights
    alien = tmp_path / "alien"
    shutil.copytree(toy_model_path, alien)
    weights = load_file(alien / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    from safetensors.torch import save_file

    save_file(weights, alien / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ProfileError, match="^quant.int8.profile: the profile was calibrated for base model"):
        profile_for("int8", quant=QuantConfig(int8=Int8Quant(profile=profile_dir, activations=profile.activations)),
                    model_path=str(alien))


def test_weight_outlier_raises_saturation(base, profile_dir):
    profile = QuantProfile.load(profile_dir)
    params = {n: p.detach().clone() for n, p in base.named_parameters()}
    quiet = monitor(base, *profile.int8_tensors(params), profile, None)
    assert quiet["quant_saturation_fraction"] == 0.0  # the calibrated weights fit their own range
    w = params["model.layers.1.mlp.up_proj.weight"]
    w[:, 7] *= 20  # an outlier input column: every row outgrows its calibrated range
    loud = monitor(base, *profile.int8_tensors(params), profile, None)
    assert loud["quant_saturation_fraction"] > 0
    worst = loud["quant_worst"]["quant_saturation_fraction"]
    assert worst["linear"] == "model.layers.1.mlp.up_proj"
    assert worst["saturation"] > 0.5 / w.shape[1]  # most of the outlier column is out of range


def test_update_below_half_a_step_is_invisible(base, profile_dir):
    profile = QuantProfile.load(profile_dir)
    params = {n: p.detach().clone() for n, p in base.named_parameters()}
    first, _ = profile.int8_tensors(params)
    previous = {k: v for k, v in first.items() if v.dtype == torch.int8}

    def visible_after(step_fraction: float) -> float:
        moved = dict(params)
        smoothed = smoothed_weights(params, profile.smoothing)
        divisor = {lin: profile.smoothing[g.norm] for g in smooth_groups(params) for lin in g.linears}
        for lin in quantized_linears(params):
            w = params[lin + ".weight"]
            # one int8 step of W * s, in units of W: (row amax of W * s) / weight_max / s
            step = smoothed[lin].abs().amax(1, keepdim=True) / profile.weight_max / divisor.get(lin, torch.ones(w.shape[1]))
            sign = torch.sign(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
            moved[lin + ".weight"] = w + step_fraction * step * sign
        return monitor(base, *profile.int8_tensors(moved), profile,
                       previous)["quant_update_visible_fraction"]

    assert visible_after(0.0) == 0.0
    assert visible_after(0.01) < 0.03  # lost in rounding
    assert visible_after(3.0) > 0.9  # three steps: almost every weight moves


def test_scaled_activations_clip_and_auto_recalibration_repairs_them(toy_model_path, profile_dir):
    from learner.policy import load_policy

    profile = QuantProfile.load(profile_dir)
    model = load_policy(toy_model_path)
    qcfg = Int8Quant(profile=profile_dir, activations=profile.activations, recalibrate="auto",
                     max_act_clip_fraction=0.01, max_kl_vs_bf16=1.0, max_saturation_fraction=1.0,
                     monitor_background=False)  # each update waits for its monitors: the rule, step by step
    wire = Int8Weights(profile, qcfg)
    _, calm = wire.prepare(model, step=1)
    assert calm["quant_act_clip_fraction"] < 0.01 and "quant_over_threshold" not in calm
    with torch.no_grad():  # the policy's activations grow 8x after layer 0's norm
        model.model.layers[0].post_attention_layernorm.weight.mul_(8)
        model.model.layers[0].input_layernorm.weight.mul_(8)
    _, m = wire.prepare(model, step=2)
    assert m["quant_act_clip_fraction_before_recalibration"] > 0.01
    assert m["quant_recalibrations_total"] == 1 and m["quant_profile"] != profile.hash
    assert wire.profile.parent == profile.hash and wire.profile.calibrated_on == "step 2"
    assert m["quant_act_clip_fraction"] < 0.01  # the new scales hold the activations
    if profile.static:  # static scales clipped: the recalibrated policy is closer to bf16
        assert m["quant_kl_vs_bf16"] < 0.5 * m["quant_kl_vs_bf16_before_recalibration"]
    _, again = wire.prepare(model, step=3)
    assert again["quant_recalibrations_total"] == 1  # nothing over threshold: no loop
    status = wire.status()  # what the learner's /status shows under "quant"
    assert status["profile"]["parent"] == profile.hash and status["last_recalibration_step"] == 2
    worst = status["monitors"]["quant_worst"]
    assert set(worst) == {"quant_saturation_fraction", "quant_update_visible_fraction", "quant_act_clip_fraction",
                          "quant_kl_vs_bf16"}
    assert all(w["linear"].startswith("model.layers.") for w in worst.values())


def test_fp8_tensors_are_per_channel_float8(base):
    params = dict(base.named_parameters())
    out = fp8_tensors(params)
    w = out["model.layers.0.mlp.down_proj.weight"]
    scale = out["model.layers.0.mlp.down_proj.weight_scale"]
    assert w.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], 1)
    ref = params["model.layers.0.mlp.down_proj.weight"].detach()
    err = (w.float() * scale - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.07
    assert out["model.norm.weight"].dtype == torch.bfloat16


def test_int8_weight_range_follows_the_machine_unless_set():
    from quant.calibrate import int8_scheme
    from quant.int8 import WEIGHT_MAX

    assert int8_scheme("full") == "int8-w8a8" and int8_scheme("7bit") == "int8-w7a8"
    flags = set(open("/proc/cpuinfo").read().split())
    vnni = bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"}) or torch.cuda.is_available()
    assert int8_scheme("auto") == ("int8-w8a8" if vnni else "int8-w7a8")
    assert WEIGHT_MAX == {"int8-w8a8": 127.0, "int8-w7a8": 63.0}


def test_a_launcher_calibrates_apart_to_the_same_profile(toy_model_path, tmp_path):
    """``rlpipe demo``/``up`` calibrate in a child process, so the launcher, which lives as
    long as the run, does not keep the model's memory; the profile is the one calibrated
    in-process."""
    from quant.quant_profile import QuantProfile

    cfg = build_config({}, environ={}, **{"model.path": toy_model_path, "quant.int8.calibration_samples": 32,
                                          "quant.int8.probe_samples": 8})
    here = resolve_quant_profile(cfg, toy_model_path, tmp_path / "here", progress=False, log=lambda m: None)
    apart = resolve_quant_profile(cfg, toy_model_path, tmp_path / "apart", progress=False, log=lambda m: None,
                                  apart=True)
    assert apart == str(tmp_path / "apart")
    a, b = QuantProfile.load(apart), QuantProfile.load(here)  # another process: float sums in another order
    assert a.input_scales == pytest.approx(b.input_scales, rel=1e-4)
    for name in b.smoothing:
        torch.testing.assert_close(a.smoothing[name], b.smoothing[name], rtol=1e-4, atol=0)


def local_collectives(model, gathered: list | None = None):
    """What a sharded learner's rank 0 gets from every rank (learner/channels.py Collectives),
    in one process: parameters whole by name (``gathered`` records each call), and a forward."""
    from learner.channels import Collectives
    from weight_sync.names import served_parameters

    params = served_parameters(model)

    def gather(names):
        if gathered is not None:
            gathered.append(list(names))
        return {n: params[n].detach() for n in names}

    return Collectives(gather, lambda ids, mask: model(ids, attention_mask=mask))


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_sharded_learner_streams_bit_for_bit_the_whole_models_quantized_tensors(base, profile_dir, precision):
    """The manifest comes from shapes alone, and each bucket is quantized from its own
    parameters as it is packed: what reaches a worker, and what a checkpoint keeps for
    returning workers, equal the whole model's quantization exactly."""
    from learner.channels import rollout_from_weights
    from quant.transfer import Fp8Weights, Stream, source_parameter
    from weight_sync.manifest import plan_buckets
    from weight_sync.names import served_parameters, served_pieces

    profile = QuantProfile.load(profile_dir)
    wire = Int8Weights(profile, Int8Quant(profile=profile_dir, activations=profile.activations)) \
        if precision == "int8" else Fp8Weights("toy")
    whole, _ = wire.prepare(base, step=1)
    gathered = []
    specs, _ = wire.prepare_sharded(base, 1, local_collectives(base, gathered))
    assert [(n, t.dtype, t.shape) for n, t in specs.items()] == [(n, t.dtype, t.shape) for n, t in whole.items()]
    assert all(t.device.type == "meta" for t in specs.values())  # no data held for the manifest
    gathered.clear()
    # Buckets of ~2 KiB: many linears' weights and scales land in different buckets.
    manifest = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in specs.items()], 2048, "", "", "gloo")
    stream = Stream(wire, local_collectives(base, gathered).gather, list(served_parameters(base)))
    sent = {}
    for bucket in manifest.buckets:
        sent.update(stream([slot.name for slot in bucket.tensors]))
    assert sorted(sent) == sorted(whole)
    for name, t in whole.items():
        assert sent[name].dtype == t.dtype and torch.equal(sent[name].float(), t.float()), name
    sources = [n for call in gathered for n in call]
    assert sorted(sources) == sorted(dict.fromkeys(source_parameter(n) for n in whole))  # each parameter once
    sizes = {n: p.numel() for n, p in served_parameters(base).items()}
    assert max(sum(sizes[n] for n in call) for call in gathered) < sum(sizes.values()) / 4  # never the whole model
    kept = rollout_from_weights(wire, served_pieces(base), dict(base.state_dict()))
    assert all(torch.equal(kept[n].float(), t.float()) for n, t in whole.items())


def test_background_monitors_report_with_a_later_update_and_no_update_waits_for_them(toy_model_path, profile_dir,
                                                                                    monkeypatch):
    """quant.int8.monitor_background: an update sends at once; its monitors' result (named for its
    step) comes with a later update, and a threshold crossed there recalibrates that update's policy
    under ``auto``; an update that finds the monitors still running skips its own and does not wait."""
    import threading

    from learner.policy import load_policy
    from quant import background

    profile = QuantProfile.load(profile_dir)
    model = load_policy(toy_model_path)
    qcfg = Int8Quant(profile=profile_dir, activations=profile.activations, recalibrate="auto",
                     max_act_clip_fraction=0.01, max_kl_vs_bf16=1.0, max_saturation_fraction=1.0)
    wire = Int8Weights(profile, qcfg)
    _, first = wire.prepare(model, step=1)
    assert "quant_act_clip_fraction" not in first  # started, not waited for
    wire.background.future.result()  # (the test waits for it; no update does)
    with torch.no_grad():  # the policy's activations grow 8x after layer 0's norm
        model.model.layers[0].post_attention_layernorm.weight.mul_(8)
        model.model.layers[0].input_layernorm.weight.mul_(8)
    _, second = wire.prepare(model, step=2)
    assert second["quant_monitor_step"] == 1 and second["quant_act_clip_fraction"] < 0.01  # step 1's, calm
    wire.background.future.result()
    _, third = wire.prepare(model, step=3)  # step 2's monitors saw the clipping: recalibrate now
    assert third["quant_monitor_step"] == 2 and third["quant_act_clip_fraction"] > 0.01
    assert third["quant_recalibrations_total"] == 1 and wire.profile.calibrated_on == "step 3"
    assert third["quant_profile"] == wire.profile.hash != profile.hash
    assert wire.background.future.result()["quant_act_clip_fraction"] < 0.01  # the recalibrated policy, monitored

    release = threading.Event()
    real = background.monitor
    monkeypatch.setattr(background, "monitor", lambda *a: (release.wait(60), real(*a))[1])
    wire.background.result()
    _, started = wire.prepare(model, step=4)
    t0 = time.perf_counter()
    _, busy = wire.prepare(model, step=5)
    assert time.perf_counter() - t0 < 10 and busy["quant_monitor_skipped_total"] == 1  # sent without waiting
    release.set()
    assert wire.background.result(wait=True)["quant_monitor_step"] == 4


def test_monitors_on_a_layer_sample_see_its_outliers_and_clipping(toy_model_path, profile_dir):
    """Under FSDP the monitors sample ``quant.int8.monitor_layers`` layers: what happens in a
    sampled layer moves them as the whole-model monitors move, and a layer outside the
    sample does not."""
    from learner.policy import load_policy

    profile = QuantProfile.load(profile_dir)
    model = load_policy(toy_model_path)
    qcfg = Int8Quant(profile=profile_dir, activations=profile.activations, monitor_layers=1)  # layer 0 only
    wire = Int8Weights(profile, qcfg)
    collectives = local_collectives(model)
    _, calm = wire.prepare_sharded(model, 1, collectives)
    assert calm["quant_monitor_layers"] == [0] and "quant_kl_vs_bf16" not in calm
    assert calm["quant_saturation_fraction"] == 0.0 and calm["quant_act_clip_fraction"] < 0.01
    assert calm["quant_worst"]["output_error"]["linear"].startswith("model.layers.0.")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[:, 7] *= 20  # outside the sample
    _, unseen = wire.prepare_sharded(model, 2, collectives)
    assert unseen["quant_saturation_fraction"] == 0.0
    assert unseen["quant_update_visible_fraction"] == 0.0  # layer 0 did not move
    wire.qcfg = Int8Quant(profile=profile_dir, activations=profile.activations, monitor_layers=2)
    wire.previous = None
    _, seen = wire.prepare_sharded(model, 3, collectives)
    assert seen["quant_monitor_layers"] == [0, 1]
    assert seen["quant_worst"]["quant_saturation_fraction"]["linear"] == "model.layers.1.mlp.up_proj"
    with torch.no_grad():  # the policy's activations grow 8x after layer 0's norms
        model.model.layers[0].post_attention_layernorm.weight.mul_(8)
        model.model.layers[0].input_layernorm.weight.mul_(8)
    _, loud = wire.prepare_sharded(model, 4, collectives)
    assert loud["quant_act_clip_fraction"] > 0.01 and loud["quant_over_threshold"]
    assert wire.status()["monitors"]["over_threshold"]  # the learner's /status shows it


def test_the_layer_sample_spreads_over_the_model_and_covers_a_small_one():
    from quant.monitor import sample_linears

    def sampled(n_layers: int, k: int) -> list[int]:
        names = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(n_layers)]
        return sorted({int(lin.split(".")[2]) for lin in sample_linears(names, k)})

    assert sampled(32, 4) == [0, 10, 21, 31] and sampled(32, 1) == [0] and sampled(32, 40) == list(range(32))
    assert sampled(2, 4) == [0, 1]  # a toy's two layers, both


def test_the_output_error_is_estimated_on_a_spread_of_tokens_and_ranks_as_the_full_one(monkeypatch):
    """quant/monitor.py ``input_stats``: the output error's two extra matmuls per linear run on at
    most ``ERROR_TOKENS`` inputs, spread over all of them (on every probe token they were a third of
    a real model's monitoring), while clipping still counts every input."""
    import torch.nn.functional as F

    from quant import monitor as m

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g)
    profile = type("P", (), {"static": False, "input_scales": {"lin": 0.01}})()
    rows = []
    real_linear = F.linear
    monkeypatch.setattr(m.F, "linear", lambda x, w, *a: rows.append(x.shape[0]) or real_linear(x, w, *a))
    errors = []
    for noise in (0.01, 0.05):  # a worse-quantized weight must rank worse, as on every token
        x = torch.randn(4000, 96, generator=g) * torch.linspace(0.5, 3.0, 4000)[:, None]
        wq = w + noise * torch.randn(w.shape, generator=g)
        got = m.input_stats(x, m.fake_quant(x, profile, "lin"), w, wq, profile, "lin")
        full = ((real_linear(m.fake_quant(x, profile, "lin"), wq) - real_linear(x, w)).norm()
                / real_linear(x, w).norm())
        assert got["inputs"] == x.numel() and got["clipped"] == int((x.abs() > 127 * 0.01).sum())
        assert got["output_error"] == pytest.approx(float(full), rel=0.1)
        errors.append(got["output_error"])
    assert rows and max(rows) <= m.ERROR_TOKENS and errors[1] > 2 * errors[0]
