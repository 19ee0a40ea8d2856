"""One rank of tests/test_fsdp.py's weight-sync check, run under torchrun with 2 gloo ranks.

Both ranks shard a randomly initialised Qwen2 (about 70 MB of fp32 weights) with the
learner's ``Ranks.wrap``. Rank 0 sends one version to the checksum worker named in the
arguments through the production ``WeightSender``, with the learner's per-bucket gather,
while rank 1 serves its gathers (``Ranks.exchange``), as the learner's ranks do. Rank 0
measures its peak resident memory (VmHWM, reset through /proc/self/clear_refs) during
the sync, and, for comparison, during a gather of the whole model at once. It writes the
two peaks, the bucket size, the model's size and the checksum of the whole model in the
wire dtype to the JSON file named in the arguments.

With ``int8`` (and a directory to save the model and its profile in) rank 0 sends through
the learner's own int8 ``SyncChannel``, with a profile made up for this random model: the
manifest from shapes alone, each bucket quantized as it is gathered, and the monitors on a
layer sample through a forward that both ranks run. The checksum it writes is then that of
the whole model quantized in one process (``profile.int8_tensors``), and it adds the
monitors' metrics.

    torchrun --nproc-per-node 2 tests/fsdp_sync_rank.py REDIS_URL RUN_ID OUT.json [int8 DIR]
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learner.channels import Collectives  # noqa: E402
from learner.dist import Ranks, exit_rank  # noqa: E402
from quant.quant_profile import QuantProfile  # noqa: E402
from rlpipe.keys import Keys  # noqa: E402
from rlpipe.peak_memory import peak_rise_kib as measure  # noqa: E402
from rlpipe.redis_link import connect  # noqa: E402
from tests.test_weight_sync import checksum  # noqa: E402
from weight_sync.sender import WeightSender  # noqa: E402

BUCKET = 1 << 20
INT8_BUCKET = 1 << 18  # int8 wire bytes: each is made from 4 gathered fp32 bytes and their temporaries
WIRE = torch.bfloat16


def made_up_profile(model, model_dir: Path) -> QuantProfile:
    """An int8 profile for a random model: smoothing vectors and static input scales drawn at
    random, each linear's calibrated range from its smoothed weights, a few probe sequences."""
    from quant.int8 import quantized_linears, smooth_groups, smoothed_weights
    from quant.quant_profile import model_fingerprint

    params = {n: p.detach() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    smoothing = {grp.norm: torch.rand(params[grp.linears[0] + ".weight"].shape[1], generator=g) + 0.5
                 for grp in smooth_groups(params)}
    smoothed = smoothed_weights(params, smoothing)
    linears = quantized_linears(params)
    probes = torch.randint(0, model.config.vocab_size, (4, 12), generator=g).tolist()
    return QuantProfile("static", 0.5, smoothing, {lin: 0.02 for lin in linears},
                        {lin: smoothed[lin].abs().amax(1) for lin in linears}, model_fingerprint(model_dir), "made-up",
                        probe_ids=probes)


def int8_channel(model, redis_url: str, run_id: str, model_dir: Path, collectives):
    """Rank 0: the learner's int8 sync channel for ``model``, saved (with its profile) in ``model_dir``."""
    from learner.channels import SyncChannel
    from rlpipe.config import build_config

    model.save_pretrained(model_dir)
    profile = made_up_profile(model, model_dir)
    profile.save(model_dir / "profile")
    cfg = build_config({}, environ={}, **{"model.path": str(model_dir), "rollout.precision": "int8",
                                          "quant.int8.profile": str(model_dir / "profile"),
                                          "quant.int8.activations": "static",
                                          "quant.int8.monitor_layers": 3, "sync.bucket_mib": INT8_BUCKET / 2**20,
                                          "sync.host": "127.0.0.1", "sync.timeout_s": 60})
    return SyncChannel(cfg, connect(redis_url), Keys(run_id), "int8", collectives), profile


def main(redis_url: str, run_id: str, out_path: str, precision: str = "bf16", model_dir: str = "") -> None:
    torch.manual_seed(0)
    ranks = Ranks("fsdp")
    # int8: twice the layers, as its monitors hold one layer at a time (the peak to compare)
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=32 if precision == "int8" else 16, num_attention_heads=4,
                         num_key_value_heads=4, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).float()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    channel = None
    if precision == "int8" and ranks.is_main:  # before sharding: rank 0 saves the model it starts from
        collectives = Collectives(lambda names: gather(names), lambda ids, mask: forward(ids, mask))
        channel, profile = int8_channel(model, redis_url, run_id, Path(model_dir), collectives)
    ranks.wrap(model)
    names = [n for n, _ in model.named_parameters()]

    handlers = {"gather": partial(ranks.full_tensors, model), "probe": partial(ranks.probe, model)}
    if not ranks.is_main:
        ranks.release(handlers)  # serve rank 0's gathers until it lets go
        ranks.close()
        exit_rank(0)

    def gather(bucket_names):
        ranks.command("gather", bucket_names)
        return ranks.full_tensors(model, bucket_names)

    def forward(ids, mask):
        ranks.command("probe", ids, mask)
        ranks.probe(model, ids, mask)

    metrics = {}
    if channel is not None:
        # A learner has run forwards before it syncs: the first one's one-time costs (FSDP's
        # lazy initialisation, kernels and modules loaded) are not the sync's.
        forward(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long))
        (stats, metrics), sync_peak = measure(lambda: channel.sync(model, 1, 1, {"w0": "a"}))
        sender = channel.sender
    else:
        sender = WeightSender(connect(redis_url), Keys(run_id), "127.0.0.1", timeout_s=60, bucket_bytes=BUCKET,
                              wire_dtype=WIRE, gather=gather)
        params = dict(model.named_parameters())
        stats, sync_peak = measure(lambda: sender.sync(1, lambda: params.items(), {"w0": "a"}))
    whole, whole_peak = measure(lambda: gather(names))
    sent = profile.int8_tensors(whole)[0] if channel is not None else {n: t.to(WIRE) for n, t in whole.items()}
    result = {"members": stats.members, "buckets": len(sender.manifest.buckets), "bucket_bytes": sender.bucket_bytes,
              "model_bytes": model_bytes, "sync_peak_kib": sync_peak, "whole_gather_peak_kib": whole_peak,
              "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
              "checksum": checksum(sent.items()), "metrics": metrics}
    sender.drop()
    ranks.release(handlers)
    ranks.close()
    Path(out_path).write_text(json.dumps(result))
    exit_rank(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
