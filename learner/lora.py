"""LoRA on a frozen base (``learner.lora.rank`` > 0): the learner trains a peft adapter, the
workers load the base once and receive only the adapter at each version (quant/transfer.py
``AdapterWeights``).

The base never moves, so it can be what the engines serve, exactly, for the whole run:
:func:`serve_base` replaces it once at start with the weights a worker of the run's
precision computes with (bf16-rounded for a bf16 fleet; for int8, the profile's int8
weights dequantized and unsmoothed, quant/int8.py ``served_base``). What is left of the
train/rollout mismatch is then the engine's activation quantization and kernels, not a
base that drifted from its quantized copy (issue 35: int8's KL against bf16 rose 0.022 ->
0.06-0.10 in 10 steps of a full fine-tune, because the base moved and the profile did not).

The KL reference is the same model with its adapter off (:class:`BaseView`): no second copy
of the weights.
"""

from __future__ import annotations

import torch

from quant.quant_profile import load_for_run
from learner.served import served_dtype
from weight_sync.adapters import saved_name
from weight_sync.names import served_parameters



def lora_config(section):
    """peft's LoraConfig for ``learner.lora``: every linear of the decoder (peft's
    ``all-linear``, which leaves the LM head out) unless ``targets`` names some."""
    from peft import LoraConfig

    return LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=list(section.targets) or "all-linear", bias="none", task_type="CAUSAL_LM")


def wrap(model, section):
    """``model`` with a fresh adapter (B = 0: at step 0 the policy is the base), only the
    adapter trainable. Its parameters are what the optimizer holds."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(section))


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def trainable(model) -> list[torch.nn.Parameter]:
    """What the optimizer steps and the served rounding touches: the adapter under LoRA, else every weight."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state(path, model) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's adapter (peft's ``adapter_model.safetensors``) under ``model``'s own
    parameter names, for learner/checkpointer.py ``load_weights``."""
    from peft.utils import load_peft_weights

    saved = load_peft_weights(str(path), device="cpu")
    wanted = {saved_name(n): n for n, p in model.named_parameters() if p.requires_grad}
    if missing := sorted(set(wanted) - set(saved)):
        raise ValueError(f"checkpoint {path}: its adapter lacks {missing[0]} ({len(missing)} missing): "
                         f"learner.lora must be what the run was checkpointed with")
    return {wanted[k]: saved[k] for k in wanted}


class BaseView:
    """The policy with its adapter off: the frozen base as served, the KL reference without a
    second model. ``collective``: under FSDP its forwards gather layers on every rank, so every
    rank must run as many (learner/step.py pads the reference's passes then)."""

    def __init__(self, model, collective: bool):
        self.model, self.collective = model, collective

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()


def served_weights(cfg, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The base's weights as a worker of the run's precision computes with them, keyed like
    ``params`` (served names), or None where they are the fp32 weights themselves."""
    if not cfg.learner.served_weights:  # the fp32 base, to measure what serving it saves (bench/seeds.py lora)
        return None
    precision = cfg.rollout.precisions[0]
    wire = cfg.quant.wire(precision)
    if wire == "int8":
        from quant.int8 import served_base

        profile = load_for_run(cfg.quant.int8, cfg.model.path)
        return served_base(params, profile.int8_tensors(params)[0], profile.smoothing)
    if wire == "fp8":
        from quant.int8 import dequantize, fp8_tensors

        return dequantize(fp8_tensors(params))
    dtype = served_dtype(cfg)  # a cast wire: the dtype its engines hold (None: fp32, nothing rounds)
    return None if dtype is None else {n: t.to(dtype).float() for n, t in params.items()}


def training_policy(cfg, path: str):
    """The model the learner trains, from ``path``: as it is, or under ``learner.lora`` the base
    as served with a fresh adapter (a resumed run then loads its checkpoint's into it)."""
    import logging

    from learner.policy import load_policy

    model = load_policy(path)
    if not cfg.learner.lora.rank:
        return model
    logging.getLogger(__name__).info("LoRA rank %d on %s", cfg.learner.lora.rank, serve_base(model, cfg))
    return wrap(model, cfg.learner.lora)


@torch.no_grad()
def serve_base(model, cfg) -> str:
    """Replace ``model``'s (unwrapped, not yet sharded) weights once with :func:`served_weights`
    and freeze them; returns what they now are, for the log."""
    params = {n: t.detach() for n, t in served_parameters(model).items()}
    served = served_weights(cfg, params)
    if served is not None:
        for name, t in served_parameters(model).items():
            t.copy_(served[name].to(t.dtype))
    model.requires_grad_(False)
    precision = cfg.rollout.precisions[0]
    return f"the base as {precision} workers serve it" if served is not None else "the base's fp32 weights"
