"""The training policy: a Hugging Face causal LM, its per-token log-probs, and its precision.

Weights and optimizer state are always fp32 (the master copy); ``bf16`` and ``fp16``
training run the forward and backward passes under ``torch.autocast``, as mixed-precision
training does on GPUs, so the same code serves both (run here on CPU only; the CUDA
autocast path is the same calls and has not been run). fp16 needs dynamic loss scaling
(seed 000): :class:`LossScaler`. With ``fp32_lm_head`` the LM head and the softmax run in
fp32 even under autocast: the logits are where low precision costs the most.

The learner divides the logits by the rollout temperature before the softmax, so its
log-probs are of the same distribution vLLM reports as ``processed_logprobs`` (with
``top_p = 1`` and ``top_k`` off, which the config warns about otherwise).
"""

from __future__ import annotations

import contextlib
import math

import torch

from learner.batch import Batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_policy(path: str):
    """The model in fp32 (the master weights whatever the training precision)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def autocast(dtype: str, device_type: str = "cpu"):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


def token_logprobs(model, batch: Batch, dtype: str = "fp32", fp32_lm_head: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, both (N, T-1), fp32.

    ``model`` may be wrapped (DistributedDataParallel): its forward is what runs, so
    gradients are synchronised. Each row's logits are divided by the temperature it was
    sampled with; the softmax runs in fp32 whatever the compute precision.
    """
    device_type = batch.input_ids.device.type
    inner = getattr(model, "module", model)
    with autocast(dtype, device_type):
        if fp32_lm_head and dtype != "fp32":
            # The whole forward still goes through ``model`` (DDP must see it); only the
            # last position's logits are computed there, and thrown away.
            hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
            with torch.autocast(device_type=device_type, enabled=False):
                logits = inner.get_output_embeddings()(hidden[:, :-1].float())
        else:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp_all = torch.log_softmax(logits.float() / batch.temperature[:, None, None], dim=-1)  # (N, T-1, V)
    logp = logp_all.gather(-1, batch.targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class LossScaler:
    """Dynamic loss scaling for fp16 (seed 000): scale the loss so small gradients survive
    fp16, skip any step whose gradients overflowed, halve the scale then, and double it
    after ``growth_interval`` clean steps. Disabled (scale 1, never skips on its own)
    for fp32 and bf16, whose exponent range needs none.

    Wraps ``torch.amp.GradScaler`` and adds what the learner reports: the scale and how
    many steps were skipped. In every precision a step whose gradient norm is not finite
    is skipped rather than allowed to write nan into the weights.
    """

    def __init__(self, dtype: str, init_scale: float = 2.0**16, device_type: str = "cpu", growth_interval: int = 200):
        self.enabled = dtype == "fp16"
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval,
                                           enabled=self.enabled)
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer, params, grad_clip: float) -> tuple[float, bool]:
        """Unscale, clip and step; returns (gradient norm before clipping, whether the step was skipped)."""
        self.scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        if self.enabled:
            before = self.scale
            self.scaler.step(optimizer)  # skips the step if unscale_ found inf/nan
            self.scaler.update()
            skipped = self.scale < before
        else:
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                optimizer.step()
        self.skipped_steps += skipped
        return grad_norm, skipped

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
