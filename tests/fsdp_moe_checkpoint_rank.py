"""One rank of tests/test_activation_checkpointing.py's sharded MoE check, run under torchrun
with 2 gloo ranks.

For each mixture-of-experts family named, and each arm (routes replayed; routes only compared
with the routers' own choice, ``learner.replay_routes: false``; a batch without routes), both
ranks build the family's tiny model as the learner does for ``learner.activation_checkpointing:
true`` and ``learner.parallel: fsdp``: its layers
checkpointed (learner/policy.py ``enable_activation_checkpointing``), then sharded by the
learner's ``Ranks.wrap`` (each MoE block a unit of its own inside its layer's), its routers
wrapped for replay (learner/routing.py ``install``). Each rank runs a forward and backward of
its own rows (row r to rank r mod 2, as the learner shares a batch out), the loss scaled so
that the averaged gradient is the whole batch's. Rank 0 then computes the same batch's
gradient in one process, on an unsharded model without checkpointing, and writes, per
family and arm, each parameter's norm-wise relative difference between the two (the sharded
gradient gathered whole), how far the gradient of the routers' own experts is from the
replayed ones' (what a recompute off the routes would be off by), and what the checkpointed
routers counted on rank 0 (each forward once, over rank 0's tokens).

    torchrun --nproc-per-node 2 tests/fsdp_moe_checkpoint_rank.py OUT.json FAMILY...
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learner import routing  # noqa: E402
from learner.dist import Ranks, exit_rank, full  # noqa: E402
from learner.policy import enable_activation_checkpointing  # noqa: E402
from tests.families import tiny_model  # noqa: E402
from tests.test_routing import random_routes  # noqa: E402

ROWS, SEQ = 4, 9


def batch_loss(model, ids: torch.Tensor, routes, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """A loss that reaches every parameter: the logits' log-sum-exp over the valid positions."""
    with routing.routes_for(model, routes, mask):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()  # as the learner
    return (logits.logsumexp(-1) * mask).sum() * scale


ARMS = {"replay": True, "compare": False, "own": None}  # learner.replay_routes; None: a batch without routes


def run(ranks: Ranks, family: str, arm: str) -> dict | None:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 20, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = mask[2, -3:] = 0  # padded rows, one a rank: padding is neither counted nor in the loss
    shape = routing.routing_shape(tiny_model(family))
    replay = ARMS[arm]
    routes = random_routes((ROWS, SEQ, shape[0], shape[1]), shape[2], seed=3) if replay is not None else None
    scale = 1.0 / int(mask.sum())

    model = tiny_model(family)
    enable_activation_checkpointing(model)
    model = ranks.wrap(model, "fp32")
    routing.install(model, replay=replay is not False)
    mine = torch.arange(ROWS)[ranks.rank :: ranks.world]
    started = time.perf_counter()
    # FSDP averages the ranks' gradients: each rank's share of the sum, times the world
    loss = batch_loss(model, ids[mine], None if routes is None else routes[mine], mask[mine], scale * ranks.world)
    loss.backward()
    seconds = time.perf_counter() - started
    tally = routing.take_tally(model)
    sharded = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}  # collectives
    if not ranks.is_main:
        return None

    def reference(replayed) -> dict[str, torch.Tensor]:
        plain = tiny_model(family)
        routing.install(plain, replay=replay is not False)
        batch_loss(plain, ids, replayed, mask, scale).backward()
        return {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}

    def relative(a: dict, b: dict) -> dict[str, float]:
        return {n: float((a[n] - g).norm() / g.norm()) for n, g in b.items() if g.norm() > 0}

    same = reference(routes)
    return {"family": family, "arm": arm, "seconds": seconds,
            "same_params": sorted(sharded) == sorted(same), "relative_diff": relative(sharded, same),
            # how far the routers' own experts' gradient is from the replayed one's: what a recompute
            # that dropped the routes would be off by
            "own_routes_diff": max(relative(reference(None), same).values()) if replay else None,
            "tally_agree": tally.agree,
            "tally_tokens": {str(k): v for k, v in tally.tokens.items()}, "tally_total": tally.total,
            "own_tokens": int(mask[mine].sum()), "own_positions": mask[mine].numel()}


def main(out_path: str, *families: str) -> None:
    torch.set_num_threads(1)
    ranks = Ranks("fsdp")
    assert ranks.sharded and ranks.world == 2
    results = [run(ranks, family, arm) for family in families for arm in ARMS]
    if ranks.is_main:
        Path(out_path).write_text(json.dumps(results))
    ranks.close()
    exit_rank(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
