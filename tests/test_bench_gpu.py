"""bench/gpu.py's plumbing on a CPU (the device check's dry run, issue 37; the GPU numbers need a
GPU): the section has every table and says its numbers are meaningless, nothing from vLLM is
imported, the IPC transport's receiver process acks every bucket through rlpipe's IpcBroadcast,
delta encode/apply round-trips, and the numeric check of the shipped W8A8 tensors fails on a
wrong scale, not only passes on the right one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))
from bench import gpu  # noqa: E402

# Runs bench/gpu.py as its own script would run, then lists any vLLM module it imported.
RUN = """import runpy, sys
sys.argv = [{script!r}, "--quick", "--device-check", "--out", {out!r}]
runpy.run_path({script!r}, run_name="__main__")
print("VLLM_MODULES", sorted(m for m in sys.modules if m.split(".")[0] == "vllm"))
"""


def test_the_device_checks_dry_run_writes_every_table_and_imports_nothing_from_vllm(tmp_path):
    out = tmp_path / "results" / "gpu.json"
    code = RUN.format(script=str(ROOT / "bench" / "gpu.py"), out=str(out.parent))
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VLLM_MODULES []" in proc.stdout
    sec = json.loads(out.read_text())
    assert sec["name"] == "gpu" and "--quick" in sec["command"] and "--device-check" in sec["command"]
    assert (out.parent / "gpu.md").read_text().startswith("## GPU")
    assert any("CPU smoke: numbers meaningless, no GPU" in n for n in sec["notes"])
    tables = {t["title"].split(" (")[0].split(",")[0]: t for t in sec["tables"]}
    assert set(tables) == {"Learner step", "Per-update quantization on the learner", "Numeric check of the shipped "
                           "W8A8 tensors against the fp32 matmul", "Checkpoint save", "IPC transport between two "
                           "processes on one GPU", "Delta encode and apply"}, list(tables)

    def rows(name):
        t = tables[name]
        return [dict(zip(t["columns"], r)) for r in t["rows"]]

    steps = rows("Learner step")  # the levers: activation checkpointing and served weights, each on and off
    for step in steps:
        assert step["step s"] > 0 and step["tokens/s"] > 0 and step["MFU"] is None  # no GPU, no peak to divide by
    levers = {(r.get("checkpointed_layers", 0), r.get("served_weights", False))
              for r in sec["data"]["learner"].values()}
    assert levers == {(0, False), (2, False), (0, True), (2, True)}, levers
    (ipc,) = rows("IPC transport between two processes on one GPU")
    assert ipc["buckets"] > 1 and ipc["IpcBroadcast s/version"] > 0 and ipc["raw copy GB/s"] > 0
    assert sec["data"]["ipc"]["receiver_exit"] == 0 and "CUDA IPC export/map skipped" in tables[
        "IPC transport between two processes on one GPU"]["note"]
    deltas = {r["wire"]: r for r in rows("Delta encode and apply")}
    assert set(deltas) == {"int8", "bf16"} and deltas["int8"]["delta bytes"] < deltas["int8"]["bucket bytes"]
    share = {w: r["delta bytes"] / r["bucket bytes"] for w, r in deltas.items()}
    assert share["bf16"] > 2 * share["int8"]  # bf16 values almost all move; 5% of int8 ones do
    quant = rows("Per-update quantization on the learner")
    assert {r["precision"] for r in quant} == {"int8", "fp8"}
    for r in quant:
        assert r["s per update"] == pytest.approx(r["layers"] * r["s per layer"] + r["embeddings s"])
    check = rows("Numeric check of the shipped W8A8 tensors against the fp32 matmul")
    assert len(check) == 4 and all(r["ok"] and 0 < r["relative error"] < r["bound"] for r in check)
    assert {r["matmul"] for r in check} == {"dequantized fp32"}
    (ckpt,) = rows("Checkpoint save")
    assert ckpt["save s"] > 0 and ckpt["on disk GiB"] > 0 and ckpt["peak host RSS above start GiB"] >= 0
    assert "multi-rank" in tables["Checkpoint save"]["note"]


def test_the_numeric_check_fails_on_a_wrong_scale_or_a_missing_smoothing():
    layer = gpu.shipped_layer("toy", tokens=32, device="cpu")
    p = layer["prefix"]

    def error(kind, module, tensors=None, smoothing="shipped"):
        x = layer["x"][module]
        ref = x @ layer["params"][p + module + ".weight"].t()
        s = layer["smoothing"][module] if smoothing == "shipped" else smoothing
        y = gpu.w8a8_output(kind, x, tensors or layer[kind], p + module, s if kind == "int8" else None, False)
        return gpu.relative_error(y, ref)

    for module in layer["x"]:
        assert error("int8", module) < gpu.ERROR_BOUND["int8"]
        assert error("fp8", module) < gpu.ERROR_BOUND["fp8"]
        doubled = {**layer["int8"], p + module + ".weight_scale": layer["int8"][p + module + ".weight_scale"] * 2}
        assert error("int8", module, doubled) > gpu.ERROR_BOUND["int8"]
        assert error("int8", module, smoothing=None) > gpu.ERROR_BOUND["int8"]  # the norm's 1/s not applied
        scale = layer["fp8"][p + module + ".weight_scale"]
        swapped = {**layer["fp8"], p + module + ".weight_scale": scale.flip(0)}  # scales on the wrong rows
        assert error("fp8", module, swapped) > gpu.ERROR_BOUND["fp8"]


def test_peak_flops_are_found_by_the_gpu_name():
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_tflops("NVIDIA H200") == 989.0
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu.peak_tflops("Tesla T4") is None
