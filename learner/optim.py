"""The learner's optimizer (``learner.optimizer``): AdamW with fp32 moments, or with 8-bit ones.

Adam keeps two moments per trainable weight. In fp32 they are twice the weights: for
SmolLM2-135M's full fine-tune 1.08 GB of the learner's memory, the largest single part of it
(docs/learner.md, "Where the gigabytes go"). ``adamw_8bit`` keeps them block-wise quantized to
8 bits (bitsandbytes' ``AdamW8bit``, the library the 8-bit optimizer comes from: Dettmers et
al., "8-bit Optimizers via Block-wise Quantization"), a quarter of the memory (0.27 GB), with
the same update rule; weights, gradients and the update's arithmetic stay fp32. bitsandbytes
leaves tensors under 4,096 elements (the norms) in fp32.

bitsandbytes is imported only when ``adamw_8bit`` is chosen: its import alone costs the
process about 0.1 GB. Its state is plain tensors in a dict, so checkpoints (learner/checkpoint.py
``optimizer_state``) save and load it as they do AdamW's. Sharded ranks (FSDP) keep AdamW:
bitsandbytes' block-wise state is per tensor, not per shard (``rlpipe/config.py`` refuses the pair).
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "adamw_8bit")


def make_optimizer(name: str, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``learner.optimizer`` names, over ``params`` (the trainable weights)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"learner.optimizer: unknown {name!r}; choose from {', '.join(OPTIMIZERS)}")


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes the optimizer's state tensors hold (its moments, scales and step counts)."""
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
