"""bench/gpu.py's device check (issue 37): what bench/gpu.py measures, plus the IPC transport
between two processes on one GPU, delta encode/apply, and the learner step with activation
checkpointing and served bf16 weights each on and off; one command, sized for at most 8 minutes on one H100:

    python bench/gpu.py --device-check --out DIR     # writes DIR/gpu.json and DIR/gpu.md

This module holds the check's own parts (:func:`measure_more`) and tables (:func:`add_tables`);
bench/gpu.py's ``device_check`` runs them after its own measurements and writes the section.
It imports nothing from bench/gpu.py: what both use (the learner step, ``attempt_part``) is in
bench/gpu_parts.py, so the import arrow runs one way, from bench/gpu.py to here.

``--quick`` (or no CUDA) is its CPU dry run: the same functions at toy sizes, imports
included. Without CUDA the IPC part cannot export or map CUDA IPC handles: the receiver
process, the gloo group, the handle's JSON encoding and the per-bucket acks all run, but the
handle is a stand-in and the receiver does not read the bytes (the section says so).

What must travel (the device image lacks it; ``scripts/gpu_wheels.sh`` downloads exactly these
into the ignored ``.whl/``, 2.8 MiB, and the run carries ``.whl``): pydantic 2.14.4,
pydantic-core 2.50.5, annotated-types 0.8.0, typing-inspection 0.4.5 (rlpipe/config.py's
pydantic, reached through rlpipe.schema and learner.batch), and typing-extensions 4.16+ (pydantic
needs >= 4.16; the device's version is unknown). Everything else the check imports is on the
device (torch, transformers, numpy, safetensors, psutil, pyyaml).
The set is what importing exactly :data:`CHECK_MODULES` pulls in beyond the standard library
(``scripts/gpu_wheels.sh --probe`` lists it again), less the device's package list.
"""

from __future__ import annotations

import asyncio
import datetime
import statistics
import time

import torch

from bench.gpu_parts import SHAPES, attempt_part, learner_step, qwen2, random_batch, sync

# Every rlpipe module the device check imports (the dry run imports exactly these).
CHECK_MODULES = ("bench.gpu", "bench.gpu_check", "bench.gpu_parts", "learner.batch", "learner.loss", "learner.policy",
                 "learner.served", "rlpipe.schema", "weight_sync.ipc", "weight_sync.delta", "weight_sync.manifest",
                 "weight_sync.transport", "weight_sync.delta_codec", "quant.int8", "quant.quant_profile",
                 "launch.results", "rlpipe.peak_memory")
DRY = "CPU dry run: CUDA IPC export/map skipped (stand-in handle, bytes not read); numbers meaningless."


# -- the IPC transport ---------------------------------------------------------------------------
def _ipc_class(cuda: bool):
    from weight_sync.ipc import IpcBroadcast

    if cuda:
        return IpcBroadcast

    class DryIpc(IpcBroadcast):
        """rlpipe's IpcBroadcast with only its CUDA calls stood in (host buffer, fake handle)."""

        def _alloc(self, nbytes):
            return torch.empty(nbytes, dtype=torch.uint8)

        def _export(self, buffer):
            return {"GPU-dry-run": (torch.Tensor, (buffer.numel(),), (1,), 0, torch.uint8, False, b"dry")}

        def _synchronize(self):
            pass

    return DryIpc


def ipc_manifest(total_bytes: int, bucket_bytes: int):
    from weight_sync.manifest import plan_buckets

    per = max(1, min(bucket_bytes, total_bytes) // 2 // 4)  # two fp32-sized bf16 tensors per bucket, roughly
    n = max(1, total_bytes // (per * 2))
    specs = [(f"layers.{i}.weight", torch.bfloat16, (per,)) for i in range(n)]
    return plan_buckets(specs, bucket_bytes, transport="ipc"), specs


def ipc_receiver(port: int, total_bytes: int, bucket_bytes: int, versions: int, cuda: bool) -> None:
    """The member's process: torch only (no vLLM). It joins the gloo pair, then for each
    version takes each bucket's handle (weight_sync.ipc.receive_version), maps it and copies
    the bucket's bytes into its own buffer (what an engine's load does), and acks."""
    from torch.distributed import TCPStore

    from weight_sync.ipc import receive_version
    from weight_sync.transport import GlooGroup

    manifest, _ = ipc_manifest(total_bytes, bucket_bytes)
    store = TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = GlooGroup(store, 1, 2, "127.0.0.1", 1, 60, 60)
    dst = torch.empty(max(b.nbytes for b in manifest.buckets), dtype=torch.uint8, device="cuda" if cuda else "cpu")

    async def load(info: dict) -> None:
        (args,) = info["ipc_handles"].values()
        n = sum(info["tensor_sizes"])
        if cuda:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            src = rebuild_cuda_tensor(*args)
            dst[:n].copy_(src[:n])
            torch.cuda.synchronize()
            del src

    for _ in range(versions):
        asyncio.run(receive_version(group, manifest, load))


def ipc_transport(total_bytes: int, bucket_bytes: int, versions: int, device: str) -> dict:
    """Bytes/s of rlpipe's IpcBroadcast (export, import in a second process, per-bucket acks)
    over ``versions`` versions after a warm-up one, against a plain device-to-device copy."""
    import multiprocessing as mp

    from torch.distributed import TCPStore

    from weight_sync.transport import GlooGroup

    cuda = device == "cuda"
    manifest, specs = ipc_manifest(total_bytes, bucket_bytes)
    tensors = {name: torch.randn(shape, device=device).to(dtype) for name, dtype, shape in specs}
    store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    proc = mp.get_context("spawn").Process(target=ipc_receiver, args=(store.port, total_bytes, bucket_bytes,
                                                                       versions + 1, cuda))
    proc.start()
    try:
        group = GlooGroup(store, 0, 2, "127.0.0.1", 1, 60, 60)
        ipc = _ipc_class(cuda)(60.0 if cuda else 15.0)  # the dry run fails fast on a missing ack
        ipc.open(group)
        times = []
        for v in range(versions + 1):
            t0 = time.perf_counter()
            failed = ipc.broadcast(manifest, tensors, None)
            if failed:
                raise RuntimeError(f"the receiver failed: {failed}")
            if v:
                times.append(time.perf_counter() - t0)
        ipc.close()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    nbytes = sum(b.nbytes for b in manifest.buckets)
    return {"bytes": nbytes, "buckets": len(manifest.buckets), "bucket_bytes": bucket_bytes, "versions": versions,
            "ipc_s": statistics.median(times), "ipc_bytes_per_s": nbytes / statistics.median(times),
            "receiver_exit": proc.exitcode, **raw_copy(nbytes, device), "dry_run": not cuda}


def raw_copy(nbytes: int, device: str, repeats: int = 5) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    s = statistics.median(times[1:])
    return {"copy_s": s, "copy_bytes_per_s": nbytes / s}


# -- delta encode and apply ----------------------------------------------------------------------
def moved(base: torch.Tensor, wire: str, fraction: float, seed: int = 0) -> torch.Tensor:
    """``base`` after one update: int8, ``fraction`` of the values one step up or down; bf16,
    every value nudged (bf16 values almost all move)."""
    g = torch.Generator(device=base.device).manual_seed(seed)
    if wire == "int8":
        step = (torch.rand(base.shape, generator=g, device=base.device) < fraction).to(torch.int8)
        return (base.to(torch.int16) + step).clamp(-127, 127).to(torch.int8)
    return (base.float() * (1 + 1e-2 * torch.randn(base.shape, generator=g, device=base.device))).to(base.dtype)


def delta_times(numel: int, device: str, repeats: int) -> list[dict]:
    """weight_sync/delta_codec.py's encode and apply_ on one flat bucket of each wire, on ``device``."""
    from weight_sync.delta_codec import apply_, checksum, encode

    rows = []
    for wire in ("int8", "bf16"):
        if wire == "int8":
            base = torch.randint(-127, 128, (numel,), dtype=torch.int8, device=device)
        else:
            base = torch.randn(numel, device=device).to(torch.bfloat16)
        new = moved(base, wire, 0.05)
        crc = checksum(base)
        enc, app = [], []
        for _ in range(repeats + 1):
            sync(device)
            t0 = time.perf_counter()
            d = encode(base, new, base_crc=crc)
            sync(device)
            t1 = time.perf_counter()
            held = base.clone()
            sync(device)
            t2 = time.perf_counter()
            apply_(held, d, held_crc=crc)
            sync(device)
            enc.append(t1 - t0)
            app.append(time.perf_counter() - t2)
        assert torch.equal(held, new), f"{wire}: the applied delta is not the new version"
        nbytes = base.numel() * base.element_size()
        rows.append({"wire": wire, "bytes": nbytes, "delta_bytes": d.nbytes, "form": d.encoding,
                     "encode_s": statistics.median(enc[1:]), "apply_s": statistics.median(app[1:])})
    return rows


# -- the learner step with activation checkpointing ----------------------------------------------
def lever_step(shape: dict, args, device: str, peak, checkpointing: bool, served: bool) -> dict:
    """bench/gpu_parts.py's learner step on a fresh random Qwen2 of ``shape`` with the learner's
    levers: each decoder layer recomputed in the backward pass
    (learner.policy.enable_activation_checkpointing), and/or the forward and backward at the
    served bf16 weights (learner.served.ServedWeights)."""
    from learner.policy import enable_activation_checkpointing

    model = qwen2(shape)
    wrapped = enable_activation_checkpointing(model) if checkpointing else 0
    r = learner_step(model, random_batch(model.config.vocab_size, args.rows, args.seq), args.steps, device, peak,
                     served=served)
    return {**r, "checkpointed_layers": wrapped, "served_weights": served}


# -- the check's parts and tables (bench/gpu.py's device_check adds them to its own) -------------
def sizes(quick: bool) -> dict:
    """The device check's sizes (H100: well inside 8 minutes with bench/gpu.py's own parts),
    and the dry run's toy ones."""
    if quick:
        return {"ipc_bytes": 1 << 20, "ipc_bucket": 1 << 18, "ipc_versions": 2, "delta_numel": 1 << 14, "repeats": 1}
    return {"ipc_bytes": 2 << 30, "ipc_bucket": 256 << 20, "ipc_versions": 3, "delta_numel": 64 << 20,
            "repeats": 3}


def measure_more(args, out: dict) -> dict:
    """The device check's parts that bench/gpu.py's ``measure`` lacks, each attempted on its
    own on a GPU (a failure is recorded and the rest run) and fatal in the dry run."""
    device = "cpu" if out["smoke"] else "cuda"
    sz = sizes(out["smoke"])

    def attempt(what, fn):
        return attempt_part(out, what, fn, device)

    shape = "toy" if out["smoke"] else "1.5B"
    for ckpt, served in ((True, False), (False, True), (True, True)):  # both off: bench/gpu.py's own row
        label = f"random Qwen2, {shape} shapes" + (", activation checkpointing" if ckpt else "") + (
            ", served bf16 weights" if served else "")
        r = attempt(f"learner step, {label}", lambda: lever_step(SHAPES[shape], args, device,
                                                                 out["peak_bf16_tflops"], ckpt, served))
        if r:
            out["learner"][label] = r
    out["ipc"] = attempt("ipc transport", lambda: ipc_transport(sz["ipc_bytes"], sz["ipc_bucket"],
                                                                sz["ipc_versions"], device))
    out["delta"] = attempt("delta encode/apply", lambda: delta_times(sz["delta_numel"], device, sz["repeats"])) or []
    return out


def add_tables(sec, res: dict) -> None:
    ipc = res.get("ipc")
    if ipc:
        sec.table("IPC transport between two processes on one GPU (weight_sync/ipc.py IpcBroadcast)",
                  ["bytes", "buckets", "bucket bytes", "versions timed", "IpcBroadcast s/version",
                   "IpcBroadcast GB/s", "raw device copy s", "raw copy GB/s"],
                  [[ipc["bytes"], ipc["buckets"], ipc["bucket_bytes"], ipc["versions"], ipc["ipc_s"],
                    ipc["ipc_bytes_per_s"] / 1e9, ipc["copy_s"], ipc["copy_bytes_per_s"] / 1e9]],
                  note=("**" + DRY + "** " if ipc["dry_run"] else "")
                  + "learner side: rlpipe's IpcBroadcast.broadcast (pack each bucket into the shared buffer, a "
                    "fresh export per version, the handle as JSON over gloo, wait for each bucket's ack); member: "
                    "a second process with torch only (weight_sync.ipc.receive_version, rebuild_cuda_tensor, a "
                    "copy of each bucket into its own buffer, ack); raw copy: one device-to-device copy_ of the "
                    "same bytes")
    if res.get("delta"):
        sec.table("Delta encode and apply (weight_sync/delta_codec.py), one bucket per wire",
                  ["wire", "bucket bytes", "delta bytes", "form", "encode s", "apply s"],
                  [[d["wire"], d["bytes"], d["delta_bytes"], d["form"], d["encode_s"], d["apply_s"]]
                   for d in res["delta"]],
                  note="int8: 5% of values one step up or down (an update of a quantized wire); bf16: every value "
                       "nudged by 1% (bf16 channels never send deltas, learner/channels.py: the row shows why); "
                       "apply_ checks the base's and the result's CRC-32")

