"""One rank of tests/test_fsdp.py's weight-sync check, run under torchrun with 2 gloo ranks.

Both ranks shard a randomly initialised Qwen2 (about 70 MB of fp32 weights) with the
learner's ``Ranks.wrap``. Rank 0 sends one version to the checksum worker named in the
arguments through the production ``WeightSender``, with the learner's per-bucket gather,
while rank 1 serves its gathers (``Ranks.exchange``), as the learner's ranks do. Rank 0
measures its peak resident memory (VmHWM, reset through /proc/self/clear_refs) during
the sync, and, for comparison, during a gather of the whole model at once. It writes the
two peaks, the bucket size, the model's size and the checksum of the whole model in the
wire dtype to the JSON file named in the arguments.

    torchrun --nproc-per-node 2 tests/fsdp_sync_rank.py REDIS_URL RUN_ID OUT.json
"""

from __future__ import annotations

import gc
import json
import sys
from functools import partial
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learner.dist import Ranks, exit_rank  # noqa: E402
from rlpipe.queue import Keys, connect  # noqa: E402
from tests.test_weight_sync import checksum  # noqa: E402
from weight_sync.sender import WeightSender  # noqa: E402

BUCKET = 1 << 20
WIRE = torch.bfloat16


def peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def measure(work) -> tuple[object, int]:
    """``work()``, and how far resident memory rose above where it was before, at its peak (KiB)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current resident size
    before = resident_kib()
    out = work()
    return out, peak_kib() - before


def main(redis_url: str, run_id: str, out_path: str) -> None:
    torch.manual_seed(0)
    ranks = Ranks("fsdp")
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=16,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).float()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ranks.wrap(model)
    names = [n for n, _ in model.named_parameters()]
    handlers = {"gather": partial(ranks.full_tensors, model)}
    if not ranks.is_main:
        ranks.release(handlers)  # serve rank 0's gathers until it lets go
        ranks.close()
        exit_rank(0)

    def gather(bucket_names):
        ranks.command("gather", bucket_names)
        return ranks.full_tensors(model, bucket_names)

    sender = WeightSender(connect(redis_url), Keys(run_id), "127.0.0.1", timeout_s=60, bucket_bytes=BUCKET,
                          wire_dtype=WIRE, gather=gather)
    params = dict(model.named_parameters())
    stats, sync_peak = measure(lambda: sender.sync(1, lambda: params.items(), {"w0": "a"}))
    whole, whole_peak = measure(lambda: gather(names))
    result = {"members": stats.members, "buckets": len(sender.manifest.buckets), "bucket_bytes": BUCKET,
              "model_bytes": model_bytes, "sync_peak_kib": sync_peak, "whole_gather_peak_kib": whole_peak,
              "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
              "checksum": checksum((n, t.to(WIRE)) for n, t in whole.items())}
    sender.drop()
    ranks.release(handlers)
    ranks.close()
    Path(out_path).write_text(json.dumps(result))
    exit_rank(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
