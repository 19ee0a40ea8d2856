"""``precision: auto`` (rlpipe/machine.py): the table picks by the CPU's flags, and the config
resolves ``auto`` where it is read, so every role reads the choice, not the word."""

from __future__ import annotations

import pytest

from rlpipe import machine
from rlpipe.config import build_config

SAPPHIRE_RAPIDS = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_int8\n"
EPYC_MILAN = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx avx2 fma\n"


@pytest.mark.parametrize("cpuinfo, rollout, flag", [(SAPPHIRE_RAPIDS, "bf16", "amx_bf16"),
                                                    (EPYC_MILAN, "fp32", "avx2")])
def test_the_table_picks_by_the_cpus_flags(cpuinfo, rollout, flag):
    row, why = machine.choose(machine.cpu_flags(cpuinfo))
    assert row.rollout == row.learner == rollout and flag in why
    assert flag in machine.cpu_name(cpuinfo)


def test_only_native_bf16_picks_bf16():
    assert machine.choose({"avx512f", "avx512_vnni", "avx2"})[0].rollout == "fp32"  # VNNI alone: no bf16 kernels
    assert machine.choose({"avx512_bf16"})[0].rollout == "bf16"
    assert machine.choose(set())[0].rollout == "fp32"  # flags unreadable: the safe row


def test_auto_resolves_where_the_config_is_read(monkeypatch):
    monkeypatch.setattr(machine, "auto_precision", lambda: ("bf16", "fp16", "a test's machine"))
    from rlpipe import config

    monkeypatch.setattr(config, "auto_precision", machine.auto_precision)
    cfg = build_config({"rollout": {"precision": "auto"}, "learner": {"dtype": "auto"}}, environ={})
    assert (cfg.rollout.precision, cfg.learner.dtype) == ("bf16", "fp16")
    assert build_config({"rollout": {"precision": "int8"}}, environ={}).rollout.precision == "int8"


GENOA = ("vendor_id\t: AuthenticAMD\ncpu family\t: 25\ncpu MHz\t\t: 2600.000\n"
         "flags\t\t: fpu avx avx2 fma avx512f avx512_bf16 avx512_vnni\n")


@pytest.mark.parametrize("cpuinfo, fp32, bf16", [
    (GENOA, 2.6 * 32, 2.6 * 64),  # Zen 4: AVX-512 on 256-bit units, VDPBF16PS twice fp32
    ("vendor_id\t: GenuineIntel\ncpu family\t: 6\ncpu MHz\t\t: 2000.0\n" + SAPPHIRE_RAPIDS, 2.0 * 64, 2.0 * 1024),
    ("vendor_id\t: AuthenticAMD\ncpu family\t: 25\ncpu MHz\t\t: 2450.0\n" + EPYC_MILAN, 2.45 * 32, None),
])
def test_a_cores_peak_follows_its_flags_and_clock(cpuinfo, fp32, bf16):
    peak = machine.core_peak(cpuinfo)
    assert peak.fp32_gflops == pytest.approx(fp32)
    assert peak.bf16_gflops == (pytest.approx(bf16) if bf16 else None)
    assert f"{peak.clock_ghz:.2f} GHz" in peak.why


def test_a_bf16_engine_runs_its_head_in_fp32_only_without_native_bf16(monkeypatch):
    monkeypatch.setattr(machine, "_cuda_capability", lambda: None)
    milan, spr = machine.cpu_flags(EPYC_MILAN), machine.cpu_flags(SAPPHIRE_RAPIDS)
    assert machine.engine_head_dtype("bfloat16", milan) == "float32"  # int8's activations are bf16
    assert machine.engine_head_dtype("bfloat16", spr) == ""  # native bf16: the head's bf16 GEMM is fast
    assert machine.engine_head_dtype("float32", milan) == ""  # already fp32
    monkeypatch.setattr(machine, "_cuda_capability", lambda: (9, 0))
    assert machine.engine_head_dtype("bfloat16", milan) == ""  # a GPU keeps its dtype


def test_the_engine_asks_vllm_for_the_head_dtype_unless_the_run_sets_hf_overrides(monkeypatch, toy_model_path):
    from quant.precision_profile import PrecisionProfile
    from rlpipe.config import RolloutConfig
    from rollout_service.engine import RolloutEngine

    def kwargs(profile, engine=None):
        return RolloutEngine(toy_model_path, profile, RolloutConfig(engine=engine or {})).engine_kwargs()

    monkeypatch.setattr(machine, "_cuda_capability", lambda: None)
    monkeypatch.setattr(machine, "cpu_flags", lambda cpuinfo=None: {"avx", "avx2", "fma"})  # AVX2 alone
    profile = PrecisionProfile("int8", "bfloat16")
    assert kwargs(profile)["hf_overrides"] == {"head_dtype": "float32"}
    assert kwargs(profile, {"hf_overrides": {"rope_theta": 1.0}})["hf_overrides"] == {"rope_theta": 1.0}  # theirs stand alone
    assert "hf_overrides" not in kwargs(PrecisionProfile("fp32", "float32"))
    monkeypatch.setattr(machine, "cpu_flags", lambda cpuinfo=None: {"avx512_bf16", "avx2"})
    assert "hf_overrides" not in kwargs(profile)
