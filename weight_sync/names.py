"""The names weights travel under: the ones in the model's checkpoint, which vLLM loads.

A Hugging Face model in memory does not always name its parameters as its checkpoint
does: transformers 5 renames some on load and back on save (GPT-NeoX's ``embed_out`` is
``lm_head`` in memory). vLLM's engine reads the checkpoint's names, so the learner sends
every update under those (:func:`served_parameters`), as ``save_pretrained`` writes them,
and a launch checks that they are the checkpoint's tensors (:func:`served_mismatch`):
else a worker refuses every update and the run waits at step 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from weight_sync.manifest import shape_mismatch


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a model directory's safetensors (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


def served_names(model: torch.nn.Module) -> dict[str, str]:
    """In-memory parameter name -> checkpoint name, by transformers' own reverse of its load-time
    conversions (the one ``save_pretrained`` applies), worked out once per model. A conversion
    that is not a renaming (several tensors fused into one, as some MoE models do) cannot be
    sent tensor by tensor: refused, naming the tensor."""
    cached = getattr(model, "_rlpipe_served_names", None)
    if cached is not None:
        return cached
    from transformers.core_model_loading import revert_weight_conversion

    names = [n for n, _ in model.named_parameters()]
    placeholders = {n: torch.empty(0, device="meta") for n in names}  # identities, not data
    reverted = revert_weight_conversion(model, dict(placeholders))
    saved_as = {id(t): n for n, t in reverted.items()}
    mapping = {}
    for name in names:
        if id(placeholders[name]) not in saved_as:
            raise ValueError(f"{type(model).__name__}: {name} is converted (not only renamed) when saved; "
                             f"rlpipe cannot send it to vLLM tensor by tensor")
        mapping[name] = saved_as[id(placeholders[name])]
    model._rlpipe_served_names = mapping
    return mapping


def served_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters (tied ones once) under the names vLLM loads them by."""
    names = served_names(model)
    return {names[n]: p for n, p in model.named_parameters()}


def served_mismatch(model_path: str | Path) -> str | None:
    """Why the learner's tensors of the model in ``model_path`` would not load into a worker's
    engine started from it (the first name or shape that differs), or None. Builds the model
    on the meta device: no weights are read, so it is quick for any size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None  # not a config transformers reads: loading the model says so, not this check
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = checkpoint_shapes(model_path)
    if not expected:
        return f"{model_path} has no *.safetensors weights (workers check every update against them)"
    sent = [(n, tuple(p.shape)) for n, p in served_parameters(model).items()]
    return shape_mismatch(sent, expected, "the learner")
