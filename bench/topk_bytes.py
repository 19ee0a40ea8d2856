"""What the sampler's top-k log-probs (score centering, ``learner.score_centering_k``) add to a record.

Score centering needs, at every sampled token, the k candidates the engine gave the most probability,
and they travel in the trajectory record (rlpipe/sampler_topk.py: int32 ids + float16 log-probs, 6
bytes a candidate). This samples the same groups from one vLLM engine with each k and reports the
encoded record's bytes per group, per sampled token, and the engine's tokens/s with each k (asking
vLLM for more log-probs costs it a top-k over the vocabulary at every step):

    python -P bench/topk_bytes.py                                  # the toy, the demo's sampling, k = 0, 8, 128
    python -P bench/topk_bytes.py --config configs/smollm2.yaml    # the real model's recipe

A --config's model, precision and sampling are used as they are; every answer runs to max_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def measure(cfg, ks: list[int], groups: int) -> list[dict]:
    """Each k's record bytes per group (the mean over ``groups`` groups) and tokens/s, one engine."""
    import numpy as np

    from quant.precision_profile import profile_for
    from rlpipe.schema import GroupRecord, Sample, encode_group
    from rollout_service.engine import RolloutEngine

    s = cfg.sampling
    engine = RolloutEngine(cfg.model.path, profile_for(cfg.rollout.precision, quant=cfg.quant, model_path=cfg.model.path),
                           cfg.rollout, seed=cfg.seed, sampler_topk=max(ks))
    await engine.start()
    prompt = [1, 2, 3, 4, 5, 6]
    rows = []
    try:
        await engine.generate(prompt, n=s.n, temperature=s.temperature, max_tokens=s.max_tokens)  # warm
        for k in ks:
            engine.sampler_topk = k
            sizes, tokens, t0 = [], 0, time.perf_counter()
            for g in range(groups):
                results, v0, v1 = await engine.generate(prompt, n=s.n, temperature=s.temperature, top_p=s.top_p,
                                                        top_k=s.top_k, max_tokens=s.max_tokens, min_tokens=s.max_tokens, seed=g,
                                                        with_topk=k > 0)
                samples = [Sample(r.tokens, r.logprobs, r.finish_reason, 0.0, topk_ids=r.topk_ids,
                                  topk_logprobs=r.topk_logprobs) for r in results]
                rec = GroupRecord("bench", "g", "p", "w", v0, v1, engine.profile.precision, "", {}, np.asarray(prompt),
                                  samples, sampler_topk=k)
                sizes.append(len(encode_group(rec)))
                tokens += sum(len(r.tokens) for r in results)
            rows.append({"k": k, "bytes_per_group": sum(sizes) / groups, "tokens_per_group": tokens / groups,
                         "tokens_per_s": tokens / (time.perf_counter() - t0)})
    finally:
        engine.shutdown()
    base = rows[0]["bytes_per_group"]
    for row in rows:
        row["added_bytes_per_group"] = row["bytes_per_group"] - base
        row["added_bytes_per_token"] = row["added_bytes_per_group"] / row["tokens_per_group"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="", help="a run config (default: the toy with the demo's sampling)")
    ap.add_argument("--k", type=int, nargs="+", default=[0, 8, 128], help="top-k sizes; the first is the baseline")
    ap.add_argument("--groups", type=int, default=8)
    args = ap.parse_args()

    from launch.toy import TOY_SPEC, ensure_toy_model
    from rlpipe.config import build_config, load_config

    if args.config:
        cfg = load_config(args.config, environ={})
    else:  # the toy, with the demo's sampling
        cfg = build_config({}, environ={}, **{"model.path": str(ensure_toy_model(TOY_SPEC, log=print)),
                                              "sampling.n": 8, "sampling.max_tokens": 8})
    for row in asyncio.run(measure(cfg, args.k, args.groups)):
        print(json.dumps({key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()}))


if __name__ == "__main__":
    main()
