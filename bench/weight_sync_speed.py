"""Weight-sync throughput: rlpipe's packed sync against one raw broadcast of the same bytes.

For each model size (random weights shaped like a decoder-only transformer, fp32 on the
learner, sent in the wire dtype), one learner and ``--receivers`` receiver processes on
loopback gloo time, side by side in the same run and the same process group:

- ``raw``: one ``torch.distributed`` broadcast of a single flat buffer holding exactly
  the bytes of the update (no packing, no manifest, no per-tensor work);
- ``raw p2p``: the same flat buffer sent point-to-point to each receiver, the transport
  rlpipe's sync uses (gloo's broadcast turns out slower than this on loopback, so this
  is the stricter floor);
- ``rlpipe``: ``WeightSender.sync`` of a new version: cast + pack, each bucket (on
  loopback) or 16 MiB chunk (to other hosts) while the ones before it are on the wire,
  header, point-to-point sends; the receivers take zero-copy views (``WeightReceiver.receive``);
- ``pack alone``: the same cast and pack with nothing sent, and the CPU seconds of it and
  of the raw send, which bound how much of the pack any overlap can hide on these cores;
- ``per-tensor``: one broadcast per parameter, cast on the fly (what naive syncs do).

With ``--link-gbit G`` the sizes from 10M up are measured again on loopback shaped to G
Gbit/s (``tc qdisc ... tbf``, root only, removed afterwards), rlpipe's sync both in chunks
and in whole buckets: there the wire, not memory, is the bottleneck, as on a real link,
and the cast can hide behind it (on plain loopback both are memory copies on one bus).

Each timing ends with a tiny all-reduce, so it counts until every receiver holds the
data. Repetitions are interleaved (raw, rlpipe, per-tensor, raw, ...) and the medians
are reported with the ratio raw_time / time (1.0 = as fast as the raw broadcast).

rlpipe's syncs are also split into the phases the learner and the workers report
(docs/weight-sync.md): prepare (cast + pack on the sender; this bench quantizes nothing,
bench/quant_cost.py times that), transfer (the send not hidden by packing), the activation
pause and convergence. A receiver here has no engine, so its *pause* is the part of an
engine's pause it can do: copying the received tensors into its own weights, the copy
vLLM's ``reload_weights`` makes with generation paused; the engine's pause/resume and
prefix-cache reset are not in it (the worker's ``rlpipe_weight_sync_pause_seconds`` is the
whole). *Convergence* runs from the start of the sync until every receiver made that copy.

    python bench/weight_sync_speed.py                # tiny .. 1B, bf16 on the wire
    python bench/weight_sync_speed.py --sizes tiny,100M --repeats 5
    python bench/weight_sync_speed.py --sizes 10M,100M,500M --link-gbit 8   # as root
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch.redis_server import EmbeddedRedis  # noqa: E402
from launch.results import Section, figure  # noqa: E402
from rlpipe.keys import Keys  # noqa: E402
from rlpipe.redis_link import connect  # noqa: E402
from weight_sync.manifest import DTYPES, Manifest, chunks, pack_chunk  # noqa: E402
from weight_sync.rendezvous import read_sync  # noqa: E402
from weight_sync.sender import CHUNK_BYTES, WeightSender  # noqa: E402

# (hidden, layers, vocab): decoder-only shapes, gated MLP of 4x hidden.
SIZES = {"tiny": (64, 2, 64), "10M": (256, 8, 8000), "100M": (768, 12, 32000),
         "500M": (1280, 24, 32000), "1B": (2048, 16, 32000)}


def model_specs(hidden: int, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    inter = 4 * hidden
    specs = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (hidden,))]
        specs += [(p + f"self_attn.{m}_proj.weight", (hidden, hidden)) for m in "qkvo"]
        specs += [(p + f"self_attn.{m}_proj.bias", (hidden,)) for m in "qkv"]
        specs += [(p + "post_attention_layernorm.weight", (hidden,))]
        specs += [(p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                  (p + "mlp.down_proj.weight", (hidden, inter))]
    return specs + [("model.norm.weight", (hidden,))]


RAW_TAG = 1 << 20  # above any bucket's tag


def cpu_seconds() -> float:
    """This process's CPU time, every thread's (gloo's own included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pack_alone(manifest: Manifest, weights: dict[str, torch.Tensor], buf: torch.Tensor) -> float:
    """Cast and pack a whole version chunk by chunk as the sender does, with nothing on the
    wire; returns the seconds it took."""
    t0 = time.perf_counter()
    for c in chunks(manifest):
        pack_chunk(manifest.buckets[c.bucket], c, weights, buf[: c.end - c.start])
    return time.perf_counter() - t0


@contextlib.contextmanager
def shaped_loopback(gbit: float):
    """Loopback limited to ``gbit`` Gbit/s (a token bucket, ``tc qdisc ... tbf``) for the
    block, so that the wire, not memory, is what a transfer waits for, as on a real link;
    yields why not when it cannot (no ``tc``, not root, loopback already shaped)."""
    tc = shutil.which("tc")
    shown = subprocess.run([tc, "qdisc", "show", "dev", "lo"], capture_output=True, text=True) if tc else None
    if shown is None or "tbf" in shown.stdout:
        yield "no tc on PATH" if shown is None else "loopback is already shaped"
        return
    added = subprocess.run([tc, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{gbit:g}gbit", "burst", "4mb",
                            "latency", "50ms"], capture_output=True, text=True)
    if added.returncode:
        yield f"tc refused: {added.stderr.strip()}"
        return
    try:
        yield ""
    finally:
        subprocess.run([tc, "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def barrier(group) -> None:
    group.world().allreduce([torch.zeros(1)]).wait(group.timeout)


def activate(staged: list[tuple[str, torch.Tensor]], weights: dict[str, torch.Tensor]) -> float:
    """Copy the received tensors into the receiver's weights (what an engine does with generation
    paused); returns the seconds it took."""
    t0 = time.perf_counter()
    for name, t in staged:
        weights[name].copy_(t)
    return time.perf_counter() - t0


def receiver(redis_url: str, run_id: str, worker_id: str, specs, wire: str, repeats: int, pauses) -> None:
    from weight_sync.receiver import WeightReceiver

    torch.set_num_threads(1)
    r, keys = connect(redis_url), Keys(run_id)
    while read_sync(r, keys.sync).candidate_of(worker_id) is None:
        time.sleep(0.01)
    st = read_sync(r, keys.sync)
    manifest = Manifest.from_json(st.manifest)
    recv = WeightReceiver.join(st.master_addr, st.master_port, st.candidate_of(worker_id), st.generation,
                               manifest, 600)
    staged = recv.receive(0, manifest)  # the warm-up sync that formed the generation
    weights = {name: torch.empty_like(t) for name, t in staged}  # this receiver's copy, activated into
    activate(staged, weights)
    barrier(recv.group)
    dtype = DTYPES[wire]
    for rep in range(repeats):
        flat = torch.empty(manifest.nbytes, dtype=torch.uint8)
        recv.group.broadcast(flat)
        barrier(recv.group)
        c0 = cpu_seconds()
        recv.group.wait(recv.group.recv(flat, 0, RAW_TAG))
        barrier(recv.group)
        pauses.put(("raw_p2p_cpu", rep, cpu_seconds() - c0))
        del flat
        staged = recv.receive(rep + 1, manifest)
        barrier(recv.group)
        pauses.put(("pause", rep, activate(staged, weights)))
        barrier(recv.group)  # every receiver activated: the version has converged
        for _, shape in specs:
            recv.group.broadcast(torch.empty(shape, dtype=dtype))
        barrier(recv.group)
    recv.close()


def bench_size(redis_url: str, name: str, receivers: int, repeats: int, wire: str, bucket_mib: float,
               chunk_bytes: int | None = None) -> dict:
    specs = model_specs(*SIZES[name])
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(shape, generator=gen) for n, shape in specs}
    params = sum(t.numel() for t in weights.values())
    run_id = f"bench-{name}-{time.monotonic_ns()}"
    ctx = mp.get_context("spawn")
    pauses = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(redis_url, run_id, f"w{i}", specs, wire, repeats, pauses),
                         daemon=True) for i in range(receivers)]
    for p in procs:
        p.start()
    sender = WeightSender(connect(redis_url), Keys(run_id), "127.0.0.1", timeout_s=600,
                          bucket_bytes=int(bucket_mib * 2**20), wire_dtype=DTYPES[wire], chunk_bytes=chunk_bytes)
    live = {f"w{i}": "bench" for i in range(receivers)}
    assert sender.sync(0, weights.items, live).members == receivers  # forms the generation
    group = sender.group
    barrier(group)
    dtype = DTYPES[wire]
    times: dict[str, list[float]] = {"raw": [], "raw_p2p": [], "rlpipe": [], "per_tensor": [], "pack_alone": []}
    cpu: dict[str, list[float]] = {"raw_p2p": [], "pack_alone": []}  # the sender's CPU seconds
    pack_manifest = replace(sender.manifest, chunk_bytes=CHUNK_BYTES)  # the pack alone, in the chunks a link gets
    scratch = torch.empty(max(c.end - c.start for c in chunks(pack_manifest)), dtype=torch.uint8)
    phases: dict[str, list[float]] = {"prepare": [], "transfer": [], "convergence": []}
    for rep in range(repeats):
        flat = torch.zeros(sender.manifest.nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        group.broadcast(flat)
        barrier(group)
        times["raw"].append(time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), cpu_seconds()
        for work in [group.send(flat, rank, RAW_TAG) for rank in range(1, receivers + 1)]:
            group.wait(work)
        barrier(group)
        times["raw_p2p"].append(time.perf_counter() - t0)
        cpu["raw_p2p"].append(cpu_seconds() - c0)
        del flat
        c0 = cpu_seconds()
        times["pack_alone"].append(pack_alone(pack_manifest, weights, scratch))
        cpu["pack_alone"].append(cpu_seconds() - c0)
        t0 = time.perf_counter()
        stats = sender.sync(rep + 1, weights.items, live)
        barrier(group)
        times["rlpipe"].append(time.perf_counter() - t0)
        barrier(group)  # the receivers copied the version into their weights
        phases["convergence"].append(time.perf_counter() - t0)
        phases["prepare"].append(stats.pack_s)  # the cast happens while packing; nothing is quantized here
        phases["transfer"].append(stats.transfer_s)
        assert stats.members == receivers and stats.form_s == 0
        t0 = time.perf_counter()
        for n, _ in specs:
            group.broadcast(weights[n].to(dtype))
        barrier(group)
        times["per_tensor"].append(time.perf_counter() - t0)
    # each version's pause is its slowest receiver's; the receivers' CPU seconds of a raw p2p add up
    slowest: dict[int, float] = {}
    for _ in range(2 * repeats * receivers):
        what, rep, seconds = pauses.get(timeout=120)
        if what == "pause":
            slowest[rep] = max(slowest.get(rep, 0.0), seconds)
        else:
            cpu["raw_p2p"][rep] += seconds
    for p in procs:
        p.join(120)
    sender.drop()
    med = {k: statistics.median(v) for k, v in times.items()}
    phase = {k: statistics.median(v) for k, v in phases.items()}
    nbytes = sender.manifest.nbytes
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    return {"size": name, "params": params, "bytes": nbytes, "buckets": len(sender.manifest.buckets),
            "raw_s": med["raw"], "raw_p2p_s": med["raw_p2p"], "rlpipe_s": med["rlpipe"], "pack_s": phase["prepare"],
            "prepare_s": phase["prepare"], "transfer_s": phase["transfer"],
            "pause_s": statistics.median(slowest.values()), "convergence_s": phase["convergence"],
            "per_tensor_s": med["per_tensor"], "rlpipe_vs_raw": med["raw"] / med["rlpipe"],
            "rlpipe_vs_raw_p2p": med["raw_p2p"] / med["rlpipe"], "pack_alone_s": med["pack_alone"],
            "raw_p2p_cpu_s": cpu_med["raw_p2p"], "pack_alone_cpu_s": cpu_med["pack_alone"],
            "hidden": (med["raw_p2p"] + med["pack_alone"] - med["rlpipe"]) / min(med["raw_p2p"], med["pack_alone"]),
            "per_tensor_vs_raw": med["raw"] / med["per_tensor"],
            "raw_gbps": nbytes * receivers / med["raw"] / 1e9, "rlpipe_gbps": nbytes * receivers / med["rlpipe"] / 1e9}


def main(argv: list[str] | None = None) -> list[dict]:
    # Sender and receivers run here on loopback and check in by candidate number: no sync token.
    for var in ("RLPIPE_SYNC_TOKEN", "RLPIPE_API_TOKEN"):
        os.environ.pop(var, None)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {list(SIZES)}")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wire-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--bucket-mib", type=float, default=256)
    ap.add_argument("--link-gbit", type=float, default=0,
                    help="also measure 10M and larger on loopback shaped to this link speed (tc tbf; root), with "
                         "chunks and with whole buckets (0: not)")
    ap.add_argument("--json", help="also write the report section (launch/results.py; raw rows in its data) here")
    args = ap.parse_args(argv)
    sizes = args.sizes.split(",")
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"--sizes: unknown {bad}; choose from {list(SIZES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp)).start()
        try:
            header = (f"{'size':>6} {'params':>13} {'MiB':>7} {'buckets':>7} {'raw s':>7} {'raw p2p s':>9} "
                      f"{'rlpipe s':>8} {'(pack s)':>8} {'per-tensor s':>12} {'rlpipe/raw':>10} "
                      f"{'rlpipe/p2p':>10} {'per-tensor/raw':>14}")
            print(f"{args.receivers} receivers, {args.wire_dtype} on the wire, {args.bucket_mib:g} MiB buckets, "
                  f"median of {args.repeats}; ratios are throughput relative to one raw broadcast", flush=True)
            print(header, flush=True)
            for name in sizes:
                row = bench_size(server.url, name, args.receivers, args.repeats, args.wire_dtype, args.bucket_mib)
                rows.append(row)
                print(f"{name:>6} {row['params']:>13,} {row['bytes'] / 2**20:>7.1f} {row['buckets']:>7} "
                      f"{row['raw_s']:>7.3f} {row['raw_p2p_s']:>9.3f} {row['rlpipe_s']:>8.3f} {row['pack_s']:>8.3f} "
                      f"{row['per_tensor_s']:>12.3f} {row['rlpipe_vs_raw']:>10.2f} {row['rlpipe_vs_raw_p2p']:>10.2f} "
                      f"{row['per_tensor_vs_raw']:>14.2f}", flush=True)
            print(f"rlpipe's syncs by phase (median; pause: the slowest receiver's copy into its weights)\n"
                  f"{'size':>6} {'prepare s':>9} {'transfer s':>10} {'pause s':>8} {'convergence s':>13}")
            for row in rows:
                print(f"{row['size']:>6} {row['prepare_s']:>9.4f} {row['transfer_s']:>10.4f} {row['pause_s']:>8.4f} "
                      f"{row['convergence_s']:>13.4f}", flush=True)
            print(f"Cast and pack overlapped with the wire (median)\n{'size':>6} {'raw p2p s':>9} {'pack alone s':>12} "
                  f"{'rlpipe s':>8} {'hidden':>6} {'p2p cpu s':>9} {'pack cpu s':>10} {'rlpipe/p2p':>10}")
            for row in rows:
                print(f"{row['size']:>6} {row['raw_p2p_s']:>9.3f} {row['pack_alone_s']:>12.3f} {row['rlpipe_s']:>8.3f} "
                      f"{row['hidden']:>6.2f} {row['raw_p2p_cpu_s']:>9.3f} {row['pack_alone_cpu_s']:>10.3f} "
                      f"{row['rlpipe_vs_raw_p2p']:>10.2f}", flush=True)
            link = shaped_rows(server.url, [n for n in sizes if n != "tiny"], args) if args.link_gbit else None
        finally:
            server.stop()
    if args.json:
        report(rows, args, link).write(args.json)
    return rows


def shaped_rows(redis_url: str, sizes: list[str], args) -> tuple[list[dict], str]:
    """Each size on a shaped link, sent in chunks and in whole buckets; returns the rows and
    why none were measured ("" when they were)."""
    rows = []
    with shaped_loopback(args.link_gbit) as why_not:
        if why_not:
            print(f"no shaped link: {why_not}", flush=True)
            return rows, why_not
        print(f"On loopback shaped to {args.link_gbit:g} Gbit/s\n{'size':>6} {'sends':>13} {'raw p2p s':>9} "
              f"{'pack alone s':>12} {'rlpipe s':>8} {'hidden':>6} {'rlpipe/p2p':>10}", flush=True)
        for name in sizes:
            for chunk in (CHUNK_BYTES, 0):
                row = bench_size(redis_url, name, args.receivers, args.repeats, args.wire_dtype, args.bucket_mib,
                                 chunk_bytes=chunk)
                row["sends"] = f"{chunk >> 20} MiB chunks" if chunk else "whole buckets"
                rows.append(row)
                print(f"{name:>6} {row['sends']:>13} {row['raw_p2p_s']:>9.3f} {row['pack_alone_s']:>12.3f} "
                      f"{row['rlpipe_s']:>8.3f} {row['hidden']:>6.2f} {row['rlpipe_vs_raw_p2p']:>10.2f}", flush=True)
    return rows, ""


def report(rows: list[dict], args, link: tuple[list[dict], str] | None = None) -> Section:
    sec = Section("weight_sync", "Weight sync: packed buckets vs raw vs per-tensor")
    sec.table(f"{args.receivers} receivers, {args.wire_dtype} on the wire, {args.bucket_mib:g} MiB buckets, "
              f"median of {args.repeats}",
              ["size", "params", "MiB", "buckets", "raw s", "raw p2p s", "rlpipe s", "(pack s)", "per-tensor s",
               "rlpipe / raw", "rlpipe / raw p2p", "per-tensor / raw"],
              [[r["size"], r["params"], r["bytes"] / 2**20, r["buckets"], r["raw_s"], r["raw_p2p_s"], r["rlpipe_s"],
                r["pack_s"], r["per_tensor_s"], r["rlpipe_vs_raw"], r["rlpipe_vs_raw_p2p"], r["per_tensor_vs_raw"]]
               for r in rows],
              note="Ratios are throughput relative to the raw transfer of the same bytes (1.0 = as fast); "
                   "rlpipe's time includes casting and packing, overlapped with the transfer.")
    sec.table("rlpipe's syncs by phase (median)", ["size", "prepare s", "transfer s", "pause s", "convergence s"],
              [[r["size"], r["prepare_s"], r["transfer_s"], r["pause_s"], r["convergence_s"]] for r in rows],
              note="Prepare: cast and pack on the sender (nothing quantized here; bench/quant_cost.py times "
                   "quantization). Transfer: the send not hidden by packing. Pause: the slowest receiver's copy "
                   "of the received tensors into its weights, the part of an engine's activation pause a receiver "
                   "without an engine has (vLLM's pause, resume and prefix-cache reset are not in it). "
                   "Convergence: from the start of the sync until every receiver made that copy.")
    sec.table("Cast and pack overlapped with the wire (median)",
              ["size", "raw p2p s", "pack alone s", "rlpipe s", "hidden", "p2p CPU s", "pack CPU s",
               "rlpipe / raw p2p"],
              [[r["size"], r["raw_p2p_s"], r["pack_alone_s"], r["rlpipe_s"], r["hidden"], r["raw_p2p_cpu_s"],
                r["pack_alone_cpu_s"], r["rlpipe_vs_raw_p2p"]] for r in rows],
              note="On loopback rlpipe sends each bucket whole, bucket i+1 cast and packed while bucket i is "
                   "sent (to other hosts, 16 MiB chunks: the next table). Pack alone: the cast and pack with "
                   "nothing sent. Hidden: the share of the shorter of "
                   "the two (the raw send, the pack alone) that rlpipe's sync hid behind the other (1 = all, 0 = "
                   "none: one after the other). p2p CPU: the CPU seconds every process spent on the raw send "
                   "(sender and receivers, gloo's threads included); pack CPU: the sender's on the pack alone. "
                   "Goal: rlpipe / raw p2p >= 0.9 at 100M and 500M.")
    sec.note("Why little hides on loopback: here the 'wire' is the kernel copying each byte twice (into the "
             "socket, out of it), on the same memory bus the cast uses. Both are bound by memory bandwidth: a raw "
             "send of 1.3 GB to one receiver moves about 5.4 GB through memory and the cast of 670M parameters 4 GB "
             "(2.7 read, 1.3 written), each alone near this VM's bandwidth, so run together they take about the sum "
             "of their times: whole buckets hide part of the pack (0.4-0.6 in the last run), and 16 MiB chunks, "
             "which add gloo's per-message handshakes, measured worse (0.47-0.77x raw p2p against 0.67-0.95x for "
             "whole buckets over four interleaved runs, 1-4 MiB chunks slower still), so a sender on a loopback "
             "`sync.host` sends whole buckets. Where the wire is slower than memory, as any real link is, the "
             "pack fits in what the transfer leaves idle: the shaped-link table shows it.")
    if link and link[0]:
        sec.table(f"On a link of {args.link_gbit:g} Gbit/s (loopback shaped with tc), median of {args.repeats}",
                  ["size", "sends", "MiB", "buckets", "raw p2p s", "pack alone s", "rlpipe s", "hidden",
                   "rlpipe / raw p2p"],
                  [[r["size"], r["sends"], r["bytes"] / 2**20, r["buckets"], r["raw_p2p_s"], r["pack_alone_s"],
                    r["rlpipe_s"], r["hidden"], r["rlpipe_vs_raw_p2p"]] for r in link[0]],
                  note="The same measurement with the wire slower than memory, as a real link is: the pack then "
                       "uses what the transfer leaves idle. 'whole buckets' sends each bucket in one piece "
                       "(`chunk_bytes` 0), bucket i+1 packed while bucket i is on the wire: the first bucket's pack "
                       "is never hidden, and a model of one bucket hides nothing. At 10M (20 MB: two chunks) the "
                       "sync takes tens of milliseconds and the ratios are noise; goal: >= 0.9 at 100M and 500M.")
    elif link:
        sec.note(f"No shaped-link measurement: {link[1]}.")
    fig, ((ax,),) = figure()
    width = 0.2
    for k, (key, label) in enumerate([("raw_s", "raw broadcast"), ("raw_p2p_s", "raw point-to-point"),
                                      ("rlpipe_s", "rlpipe (cast + pack + send)"), ("per_tensor_s", "per-tensor")]):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))],
               [r["bytes"] * args.receivers / r[key] / 1e9 for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [r["size"] for r in rows])
    ax.set_ylabel("GB/s delivered (all receivers)")
    ax.set_xlabel("model size")
    ax.legend(fontsize=8)
    sec.plot(fig, "throughput", "Delivered bandwidth by model size and method, loopback gloo")
    sec.note("Measured with gloo over loopback TCP on this machine's CPU cores: the learner and every receiver share "
             "the same memory bus, so absolute GB/s are a CPU fact. On GPU clusters the transport is NCCL over "
             "NVLink or InfiniBand (not testable here: no machine with two GPUs), through vLLM's own packed "
             "broadcast, whose packing a GPU does far faster than the wire moves it; the per-tensor method's launch "
             "overhead grows there.")
    sec.data = rows + (link[0] if link else [])
    return sec


if __name__ == "__main__":
    main()
