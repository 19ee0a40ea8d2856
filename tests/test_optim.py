"""learner.optimizer: AdamW's moments in 8 bits take a quarter of the memory, follow fp32
AdamW's steps, survive a checkpoint, and are refused where ranks shard the tensors."""

from __future__ import annotations

import pytest
import torch

from launch.checks import validate_run
from learner.checkpoint import host_copy, load_optimizer_state, optimizer_state
from learner.optim import BLOCK, chunked_adamw_8bit, make_optimizer, state_bytes
from rlpipe.config import ConfigError, build_config

pytest.importorskip("bitsandbytes")


def small_model(seed: int = 0) -> torch.nn.Module:
    """Tensors above bitsandbytes' 4,096-element threshold (quantized) and a norm below it (kept fp32)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 512))


def train(model, opt, steps: int, seed: int = 1) -> list[float]:
    """A next-token task on fixed random data: cross-entropy per step, gradients clipped as the learner does."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 512, (16, 12), generator=gen)
    losses = []
    for _ in range(steps):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_eight_bit_moments_take_a_quarter_of_adamws_memory():
    sizes = {}
    for name in ("adamw", "adamw_8bit"):
        model = small_model()
        opt = make_optimizer(name, model.parameters(), 1e-3, 0.0)
        train(model, opt, 1)
        sizes[name] = state_bytes(opt)
    weights = sum(p.numel() * 4 for p in small_model().parameters())
    assert sizes["adamw"] == pytest.approx(2 * weights, rel=0.01)  # two fp32 moments
    assert sizes["adamw_8bit"] < 0.3 * sizes["adamw"]  # two 8-bit moments, block scales, fp32 norms


def test_eight_bit_adamw_takes_the_steps_fp32_adamw_takes():
    """Its quantization error is small against a step: after 30 steps both models moved the
    same way (their moves' cosine near 1) by about as much, and the loss fell alike. A wrong
    rule (SGD's step of the same lr, here) moves the weights elsewhere."""
    start = flat(small_model())
    runs = {}
    for name in ("adamw", "adamw_8bit", "sgd"):
        model = small_model()
        opt = (torch.optim.SGD(model.parameters(), lr=1e-2) if name == "sgd"
               else make_optimizer(name, model.parameters(), 1e-2, 0.0))
        losses = train(model, opt, 30)
        runs[name] = (flat(model) - start, losses)
    ref, ref_losses = runs["adamw"]
    move, losses = runs["adamw_8bit"]
    cos = torch.nn.functional.cosine_similarity(ref, move, dim=0).item()
    assert cos > 0.95, cos
    assert move.norm().item() == pytest.approx(ref.norm().item(), rel=0.1)
    assert losses[-1] < 0.7 * losses[0] and abs(losses[-1] - ref_losses[-1]) < 0.1 * ref_losses[0]
    assert torch.nn.functional.cosine_similarity(ref, runs["sgd"][0], dim=0).item() < 0.9


@pytest.mark.parametrize("slice_size", [4 * BLOCK, 5 * BLOCK])
def test_a_large_tensor_updated_slice_by_slice_takes_bitsandbytes_own_steps_bit_for_bit(slice_size):
    """The learner's 8-bit AdamW updates a tensor above its slice size in slices (the kernel's fp32
    temporaries of one slice, not of the whole tensor): the weights and the 8-bit moments after 5
    steps are bitsandbytes' own, to the bit. A slice given the block scales of the next slice
    quantizes against the wrong scale and fails this; a slice size off the blocks is refused."""
    import bitsandbytes as bnb

    runs = {}
    for name, cls in (("whole", bnb.optim.AdamW8bit), ("sliced", chunked_adamw_8bit(slice_size))):
        model = small_model()  # 32,768 and 16,384-weight tensors: several slices each, and a part slice
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.01)
        train(model, opt, 5)
        runs[name] = (flat(model), torch.cat([opt.state[p]["state2"].reshape(-1).float() for p in model.parameters()]))
    assert torch.equal(runs["sliced"][0], runs["whole"][0])
    assert torch.equal(runs["sliced"][1], runs["whole"][1])
    with pytest.raises(AssertionError, match="whole blocks"):
        chunked_adamw_8bit(BLOCK + 1)


def test_eight_bit_state_survives_a_checkpoint_round_trip():
    """The learner's checkpoint format (state keyed by parameter name) holds bitsandbytes'
    state: a restored optimizer takes the same next steps as the one that went on."""
    model = small_model()
    opt = make_optimizer("adamw_8bit", model.parameters(), 1e-2, 0.0)
    train(model, opt, 5)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = host_copy(optimizer_state(model, opt))  # what a checkpoint's snapshot holds
    train(model, opt, 3, seed=2)
    went_on = flat(model)

    restored = small_model(seed=7)
    restored.load_state_dict(saved_weights)
    opt2 = make_optimizer("adamw_8bit", restored.parameters(), 1e-2, 0.0)
    load_optimizer_state(restored, opt2, saved)
    train(restored, opt2, 3, seed=2)
    assert torch.equal(flat(restored), went_on)

    fresh = small_model(seed=7)  # without the state: Adam starts over, and the steps differ
    fresh.load_state_dict(saved_weights)
    train(fresh, make_optimizer("adamw_8bit", fresh.parameters(), 1e-2, 0.0), 3, seed=2)
    assert not torch.allclose(flat(fresh), went_on)


def test_eight_bit_optimizer_is_refused_on_sharded_ranks_naming_the_key():
    with pytest.raises(ConfigError, match=r"learner\.optimizer: adamw_8bit .* learner\.parallel: fsdp"):
        validate_run(build_config({"learner": {"ranks": 2, "optimizer": "adamw_8bit"}}, environ={}))
    validate_run(build_config({"learner": {"ranks": 2, "parallel": "ddp", "optimizer": "adamw_8bit"}}, environ={}))
    validate_run(build_config({"learner": {"optimizer": "adamw_8bit"}}, environ={}))
    with pytest.raises(ConfigError, match="learner.optimizer"):
        build_config({"learner": {"optimizer": "lion"}}, environ={})
