"""The learner's optimizer (``learner.optimizer``): AdamW with fp32 moments, or with 8-bit ones.

Adam keeps two moments per trainable weight. In fp32 they are twice the weights: for
SmolLM2-135M's full fine-tune 1.08 GB of the learner's memory, the largest single part of it
(docs/learner.md, "Where the gigabytes go"). ``adamw_8bit`` keeps them block-wise quantized to
8 bits (bitsandbytes' ``AdamW8bit``, the library the 8-bit optimizer comes from: Dettmers et
al., "8-bit Optimizers via Block-wise Quantization"), a quarter of the memory (0.27 GB), with
the same update rule; weights, gradients and the update's arithmetic stay fp32. bitsandbytes
leaves tensors under 4,096 elements (the norms) in fp32.

bitsandbytes' CPU kernel dequantizes a tensor's two moments to fp32 for its update, with a
scaled gradient and a denominator beside them: about 20 bytes a weight for the time of that
tensor's update. For SmolLM2's 28M-weight embedding that is half a gigabyte, and it set the
learner's peak. :class:`ChunkedAdamW8bit` updates a large tensor a slice at a time instead (slices
on the 256-weight block boundaries of the moments' scales, so the arithmetic is the same, bit for
bit): the temporaries of one slice, whatever the tensor.

bitsandbytes is imported only when ``adamw_8bit`` is chosen: its import alone costs the
process about 0.1 GB. Its state is plain tensors in a dict, so checkpoints (learner/checkpoint.py
``optimizer_state``) save and load it as they do AdamW's. Sharded ranks (FSDP) keep AdamW:
bitsandbytes' block-wise state is per tensor, not per shard (``rlpipe/config.py`` refuses the pair).
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "adamw_8bit")
BLOCK = 256  # bitsandbytes' block of weights per moment scale (absmax) in its 8-bit optimizers
SLICE = 1 << 21  # weights a slice: 2M, about 40 MB of the kernel's temporaries


def make_optimizer(name: str, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``learner.optimizer`` names, over ``params`` (the trainable weights)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw_8bit":
        return chunked_adamw_8bit()(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"learner.optimizer: unknown {name!r}; choose from {', '.join(OPTIMIZERS)}")


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes the optimizer's state tensors hold (its moments, scales and step counts)."""
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def chunked_adamw_8bit(slice_size: int = SLICE) -> type:
    """bitsandbytes' ``AdamW8bit`` whose update of a tensor larger than ``slice_size`` weights runs
    slice by slice over flat views of the weights, gradient, moments and their block scales (the
    class is built here so bitsandbytes is imported only when chosen)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    assert slice_size % BLOCK == 0, "a slice must hold whole blocks of the moments' scales"

    class ChunkedAdamW8bit(bnb.optim.AdamW8bit):
        def update_step(self, group, p, gindex, pindex):
            state = self.state[p]
            if state["state1"].dtype != torch.uint8 or p.numel() <= slice_size:
                return super().update_step(group, p, gindex, pindex)
            p.data, p.grad = p.data.contiguous(), p.grad.contiguous()
            config = self.get_config(gindex, pindex, group)
            state["step"] += 1
            flat = [t.view(-1) for t in (p.grad, p.data, state["state1"], state["state2"])]
            for start in range(0, p.numel(), slice_size):
                part = slice(start, start + slice_size)
                blocks = slice(start // BLOCK, -(-(start + slice_size) // BLOCK))
                g, w, m1, m2 = (t[part] for t in flat)
                F.optimizer_update_8bit_blockwise(
                    self.optimizer_name, g, w, m1, m2, config["betas"][0], config["betas"][1], 0.0, 0.0,
                    config["eps"], state["step"], config["lr"], state["qmap1"], state["qmap2"],
                    state["absmax1"][blocks], state["absmax2"][blocks], config["weight_decay"],
                    gnorm_scale=1.0, skip_zeros=config["skip_zeros"])

    ChunkedAdamW8bit.__name__ = ChunkedAdamW8bit.__qualname__ = "ChunkedAdamW8bit"
    return ChunkedAdamW8bit
