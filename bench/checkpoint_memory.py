"""Rank 0's memory during one checkpoint of a sharded learner: the full format (the
weights and the Adam state gathered whole on rank 0) against the sharded one (each rank
writes its own optimizer shard with torch.distributed.checkpoint; only the weights are
gathered, for the Hugging Face directory).

Each format runs in fresh processes: 2 gloo ranks under torchrun shard a randomly
initialised Qwen2 (``--layers``, about 4.3 MB of fp32 weights a layer plus 2 MB of
embeddings and head) with the learner's ``Ranks.wrap``, take one AdamW step (so the Adam
moments exist, twice the weights' size), and checkpoint once, synchronously, with the
learner's own ``Checkpointer`` (learner/checkpointer.py): rank 0 leads and rank 1 serves
its command. Rank 0 records how far its resident memory rose above where it was before
the checkpoint, at its peak (VmHWM, reset through /proc/self/clear_refs), and the bytes of
tensors it gathered whole. The checkpoints' weights must agree bit for bit.

    python bench/checkpoint_memory.py                 # 16 layers: 70 MB of weights, 140 MB of Adam state
    python bench/checkpoint_memory.py --layers 32 --out /tmp/ckpt_mem.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlpipe.peak_memory import peak_rise_kib  # noqa: E402


def rank_main(fmt: str, layers: int, root: str, out_path: str) -> None:
    """One rank's part (under torchrun)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner import checkpoint
    from learner.checkpointer import Checkpointer
    from learner.dist import Ranks, exit_rank

    torch.manual_seed(0)
    ranks = Ranks("fsdp")
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).float()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ranks.wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 1024, (2, 16))).logits.float().mean().backward()
    opt.step()
    opt_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())  # global shapes
    held = {}  # the bytes of the tensors rank 0 holds for the write

    def tensor_bytes(obj) -> int:
        if hasattr(obj, "to_local"):
            obj = obj.to_local()
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        return sum(tensor_bytes(v) for v in values)

    # What rank 0 hands the writes: recorded on the way through, the writes themselves unchanged.
    save, save_shards = checkpoint.save, checkpoint.save_shards

    def recording_save(*args, weights=None, **kwargs):
        held["weights"] = tensor_bytes(weights)
        held["optimizer"] = held.get("optimizer", 0) + tensor_bytes(args[3].get("optimizer", {}))
        return save(*args, weights=weights, **kwargs)

    def recording_save_shards(path, shards, group):
        if ranks.is_main:
            held["optimizer"] = held.get("optimizer", 0) + tensor_bytes(shards)
        return save_shards(path, shards, group)

    checkpoint.save, checkpoint.save_shards = recording_save, recording_save_shards
    checkpoints = Checkpointer(Path(root), model, opt, ranks, sharded=fmt == "sharded", async_write=False,
                               base_model="", keep=2)
    handlers = {"snapshot": checkpoints.snapshot, "shards": checkpoints.write_shards}
    if not ranks.is_main:
        ranks.release(handlers)  # serve rank 0's command until it lets go
        checkpoints.close()
        ranks.close()
        exit_rank(0)

    def take_checkpoint() -> Path:  # Learner.checkpoint with learner.async_checkpoint false
        checkpoints.start(1, 1, {}, {"version": 1}, {}, lambda: None)
        return checkpoints.durable()[0]

    t0 = time.perf_counter()
    path, peak = peak_rise_kib(take_checkpoint)
    seconds = time.perf_counter() - t0
    ranks.release(handlers)
    ranks.close()
    Path(out_path).write_text(json.dumps({
        "format": fmt, "peak_rise_kib": peak, "seconds": seconds, "model_bytes": model_bytes,
        "optimizer_bytes": opt_bytes, "held_weights_bytes": held["weights"],
        "held_optimizer_bytes": held["optimizer"], "path": str(path),
        "files_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file())}))
    exit_rank(0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="decoder layers of the random Qwen2 (4.3 MB each)")
    ap.add_argument("--out", default="", help="also write the JSON of every number here")
    args = ap.parse_args(argv)
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    arms = {}
    with tempfile.TemporaryDirectory(prefix="rlpipe-ckpt-mem-") as tmp:
        for fmt in ("full", "sharded"):
            out = Path(tmp) / f"{fmt}.json"
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   "2", __file__, "--rank-main", fmt, str(args.layers), str(Path(tmp) / fmt),
                                   str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
            if proc.returncode != 0:
                raise SystemExit(f"{fmt}: torchrun failed\n{proc.stderr[-3000:]}")
            arms[fmt] = json.loads(out.read_text())
        a, b = (load_file(Path(arms[f]["path"]) / "model.safetensors") for f in ("full", "sharded"))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "the two formats saved different weights"
    mib = 1 << 20
    full, sharded = arms["full"], arms["sharded"]
    print(f"Rank 0's resident memory during one synchronous checkpoint, 2 FSDP gloo ranks, a random Qwen2 of "
          f"{args.layers} layers: {full['model_bytes'] / mib:.0f} MiB of fp32 weights, "
          f"{full['optimizer_bytes'] / mib:.0f} MiB of Adam state (whole, both ranks' shards)")
    print("\n| learner.checkpoint_format | rank 0's peak rise MiB | weights it holds MiB | optimizer state it "
          "holds MiB | seconds | checkpoint on disk MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in (full, sharded):
        print(f"| {r['format']} | {r['peak_rise_kib'] / 1024:.0f} | {r['held_weights_bytes'] / mib:.0f} | "
              f"{r['held_optimizer_bytes'] / mib:.0f} | {r['seconds']:.2f} | {r['files_bytes'] / mib:.0f} |")
    report = {"layers": args.layers, "arms": arms}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()
