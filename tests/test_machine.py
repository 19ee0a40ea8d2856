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
