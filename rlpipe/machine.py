"""What this machine computes fastest: the table behind ``precision: auto``.

``rollout.precision: auto`` and ``learner.dtype: auto`` resolve here, once, where the config is
read (the launcher writes the resolved config every role reads). The choice is a row of
:data:`CHOICES`, the first whose CPU flags this machine has; each row says why, from
measurements of SmolLM2-135M on one core (docs/quantization.md "Which precision auto picks"):

- native bf16 (``amx_bf16`` or ``avx512_bf16``, e.g. Intel Sapphire Rapids): vLLM's bf16 decode
  was 2.5x fp32's at batch 64 and the learner's bf16 step 1.47x fp32's. int8 W8A8 decoded 1.21x
  bf16 there without an adapter, but 0.69x with one, and it adds a quantization mismatch, so it
  stays a choice made by name (``--precision int8``);
- anything else (AVX2 alone, e.g. AMD EPYC Milan): fp32. Without native bf16, vLLM's bf16 linears
  fall back to torch (1.1 GFLOP/s against fp32's 34.5 on one core). An engine that still computes
  in bf16 there (int8's activations are bf16) runs its LM head in fp32 (:func:`engine_head_dtype`):
  SmolLM2's 49,152-way bf16 head took 44% of the int8 engine's decode step (py-spy), and in fp32
  the engine decoded 1.44x faster, as fast as fp32 (103.5 against 103.1 tokens/s at batch 64);
  fp32 stays the choice there, as it adds no quantization mismatch.

A CUDA device picks bf16 (compute capability 8.0 and up) or fp16. Kept free of heavy imports:
the config reads it; torch is imported only where a GPU is present.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Choice:
    flags: tuple[str, ...]  # any one of them selects the row; () = every CPU
    rollout: str
    learner: str
    why: str
    head: str = ""  # the LM head's dtype for an engine computing in bf16 or fp16 ("" = the engine's own)


CHOICES: tuple[Choice, ...] = (
    Choice(("amx_bf16", "avx512_bf16"), "bf16", "bf16",
           "native bf16 ({flag}): bf16 decodes about 2.5x and steps about 1.5x fp32"),
    Choice((), "fp32", "fp32",
           "no native bf16 ({flags}): bf16 falls back to slow kernels, and fp32 is the fastest", head="float32"),
)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line); empty where unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def simd_summary(flags: set[str]) -> str:
    """The flags that choose the kernels, as ``lscpu`` names them (for a summary's line)."""
    known = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx512f", "avx_vnni", "avx2")
    return ", ".join(f for f in known if f in flags) or "none of avx2/avx512/amx"


def choose(flags: set[str]) -> tuple[Choice, str]:
    """The row for a CPU with ``flags`` and its reason, in words."""
    for row in CHOICES:
        hit = next((f for f in row.flags if f in flags), None)
        if hit or not row.flags:
            return row, row.why.format(flag=hit, flags=simd_summary(flags))
    raise AssertionError("CHOICES ends with a row for every CPU")


def _cuda_capability() -> tuple[int, int] | None:
    if not any(Path("/dev").glob("nvidia[0-9]*")) or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return None
    try:
        import torch

        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no usable GPU: the CPU's row
        return None


@functools.lru_cache(maxsize=1)
def auto_precision() -> tuple[str, str, str]:
    """``(rollout precision, learner dtype, why)`` for this machine."""
    capability = _cuda_capability()
    if capability is not None:
        dtype = "bf16" if capability >= (8, 0) else "fp16"
        return dtype, dtype, f"a CUDA device of compute capability {capability[0]}.{capability[1]}"
    row, why = choose(cpu_flags())
    return row.rollout, row.learner, why


def engine_head_dtype(engine_dtype: str, flags: set[str] | None = None) -> str:
    """The LM head's dtype for a vLLM engine of ``engine_dtype`` on this machine's CPU ("" = the
    engine's own): vLLM's ``head_dtype`` override. The head is the step's largest linear (a row per
    vocabulary entry), and its bf16 GEMM is as slow as any other bf16 linear without native bf16,
    where fp32 is fast; fp32 logits are also what the learner computes. A GPU keeps its dtype."""
    if engine_dtype in ("float32", "fp32") or _cuda_capability() is not None:
        return ""
    return choose(cpu_flags() if flags is None else flags)[0].head


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name and the flags that choose the kernels, for a summary or a bench table."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                "unknown CPU")
    return f"{name}, {os.cpu_count()} cores ({simd_summary(cpu_flags(cpuinfo))})"


@dataclass(frozen=True)
class CorePeak:
    clock_ghz: float
    fp32_gflops: float
    bf16_gflops: float | None  # None: no native bf16 arithmetic
    why: str


def core_peak(cpuinfo: str | None = None) -> CorePeak:
    """One core's dense peak in GFLOP/s, from its flags and clock (``cpu MHz``, the nominal
    clock on a VM: a core that boosts above it can measure past this peak).

    FLOPs per cycle, the vendors' figures for fused multiply-adds: AVX2 with FMA 32 fp32 (two
    256-bit FMA units); AVX-512 64 on Intel and AMD Zen 5 (two 512-bit units), 32 on Zen 4
    (family 25: 512-bit instructions on 256-bit units); ``avx512_bf16`` (VDPBF16PS, two bf16
    products a lane) twice fp32; AMX (``amx_bf16``) 1,024 bf16 a cycle. Without native bf16
    there is no bf16 peak: such a CPU's bf16 runs on fp32 units at best."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    field = lambda key: next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()  # noqa: E731
                              if line.split(":", 1)[0].strip() == key), "")
    flags = cpu_flags(cpuinfo)
    ghz = float(field("cpu MHz") or 0) / 1000
    amd, family = field("vendor_id") == "AuthenticAMD", int(field("cpu family") or 0)
    if "avx512f" in flags:
        fp32, unit = (32, "AVX-512 on 256-bit units (AMD Zen 4)") if amd and family == 25 else (64, "AVX-512")
    elif "fma" in flags and "avx2" in flags:
        fp32, unit = 32, "AVX2 with FMA"
    else:
        fp32, unit = (16 if "avx" in flags else 8), "no FMA"
    if "amx_bf16" in flags:
        bf16, how = 1024, "AMX"
    elif "avx512_bf16" in flags:
        bf16, how = 2 * fp32, "avx512_bf16"
    else:
        bf16, how = None, "no native bf16"
    return CorePeak(ghz, fp32 * ghz, bf16 * ghz if bf16 else None,
                    f"{ghz:.2f} GHz x {fp32} fp32 FLOP/cycle ({unit}); bf16: "
                    + (f"{bf16} FLOP/cycle ({how})" if bf16 else how))
