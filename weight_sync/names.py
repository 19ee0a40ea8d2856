"""The names weights travel under: the ones in the model's checkpoint, which vLLM loads.

A Hugging Face model in memory does not always name its parameters as its checkpoint
does: transformers 5 renames some on load and back on save (GPT-NeoX's ``embed_out`` is
``lm_head`` in memory). vLLM's engine reads the checkpoint's names, so the learner sends
every update under those (:func:`served_parameters`), as ``save_pretrained`` writes them,
and a launch checks that they are the checkpoint's tensors (:func:`served_mismatch`):
else a worker refuses every update and the run waits at step 0. An MoE layer's experts are
one fused tensor in memory ([experts, ...]) and one tensor per expert and projection in the
checkpoint: those are sent as views of the fused tensor (:class:`Piece`), not copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Piece:
    """Where one checkpoint tensor lives in memory: the parameter ``param`` whole (``view``
    None: the same tensor, perhaps renamed), or a view of it, ``(size, stride, offset)`` into
    the parameter's contiguous elements (one expert's slice of a fused MoE tensor)."""

    param: str
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of ``tensor`` (the parameter, or the parameter gathered whole): a view, no copy."""
        if self.view is None:
            return tensor
        size, stride, offset = self.view
        t = tensor.detach().contiguous()  # a parameter is contiguous: no copy
        return t.as_strided(size, stride, t.storage_offset() + offset)


class _KeepViews(torch.overrides.TorchFunctionMode):
    """``.contiguous()`` is the tensor itself, so that a slice transformers' conversion makes
    (``torch.chunk(...).contiguous()``) stays a view whose stride and offset say where it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return func(*args, **(kwargs or {}))


def served_pieces(model: torch.nn.Module) -> dict[str, Piece]:
    """Checkpoint name -> where its tensor is in memory, by transformers' own reverse of its
    load-time conversions (the one ``save_pretrained`` applies), run once per model on meta
    tensors of the parameters' shapes: a renamed parameter is one piece, a fused one (an MoE
    layer's experts, [experts, ...]) is one piece per slice the checkpoint keeps. A conversion
    that is neither (several parameters merged into one checkpoint tensor) cannot be sent
    slice by slice: refused with ValueError, naming the tensor."""
    cached = getattr(model, "_rlpipe_served_pieces", None)
    if cached is not None:
        return cached
    from transformers.core_model_loading import revert_weight_conversion

    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    placeholders = {n: torch.empty(s, device="meta") for n, s in shapes.items()}  # identities and shapes, no data
    with _KeepViews():
        reverted = revert_weight_conversion(model, dict(placeholders))
    param_of = {id(t): n for n, t in placeholders.items()}
    pieces, covered = {}, dict.fromkeys(shapes, 0)
    for saved, t in reverted.items():
        root = t if t._base is None else t._base
        if id(root) not in param_of:
            raise ValueError(f"{type(model).__name__}: {saved} is made from several tensors when saved; "
                             f"rlpipe cannot send it to vLLM tensor by tensor")
        name = param_of[id(root)]
        whole = t is root
        pieces[saved] = Piece(name, None if whole else (tuple(t.shape), t.stride(), t.storage_offset()))
        covered[name] += t.numel()
    for name, shape in shapes.items():
        if covered[name] != math.prod(shape):
            raise ValueError(f"{type(model).__name__}: {name} is converted (not only renamed or split) when "
                             f"saved; rlpipe cannot send it to vLLM tensor by tensor")
    model._rlpipe_served_pieces = pieces
    return pieces


def served_tensors(pieces: dict[str, Piece], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor, from ``weights`` keyed by parameter name (parameters, or
    copies gathered whole): fused tensors' slices are views of them."""
    return {name: pc.of(weights[pc.param]) for name, pc in pieces.items()}


def parameter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter name -> tensor, from ``tensors`` keyed by checkpoint name (the inverse of
    :func:`served_tensors`): a fused parameter (an MoE layer's experts) is assembled from its
    slices, so a ``functional_call`` can run the model at weights made under served names
    (quant/monitor.py's simulated int8 policy)."""
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, pc in served_pieces(model).items():
        t = tensors[name]
        if pc.view is None:
            out[pc.param] = t
        else:
            whole = out.setdefault(pc.param, torch.empty(params[pc.param].shape, dtype=t.dtype))
            pc.of(whole).copy_(t)
    return out


def served_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters (tied ones once) under the names vLLM loads them by: a
    parameter itself where the checkpoint only renames it, a view where it keeps slices (a
    sharded parameter's slice has no local view: a meta tensor of its whole shape, for the
    manifest; learner/dist.py gathers the parameter, then slices)."""
    pieces, params = served_pieces(model), dict(model.named_parameters())
    out = {}
    for name, pc in pieces.items():
        p = params[pc.param]
        out[name] = torch.empty(pc.view[0], dtype=p.dtype, device="meta") \
            if pc.view is not None and hasattr(p, "full_tensor") else pc.of(p)
    return out


def meta_model(model_path: str | Path) -> torch.nn.Module | None:
    """The model in ``model_path`` built on the meta device from its config alone (no weights
    read, so quick for any size), for the launch checks; None when transformers cannot read
    the config (loading the model says so, not a check)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def served_mismatch(model_path: str | Path) -> str | None:
    """Why the learner's tensors of the model in ``model_path`` would not load into a worker's
    engine started from it (the first name or shape that differs), or None (:func:`meta_model`)."""
    model = meta_model(model_path)
    if model is None:
        return None
    expected = checkpoint_shapes(model_path)
    if not expected:
        return f"{model_path} has no *.safetensors weights (workers check every update against them)"
    sent = [(n, tuple(p.shape)) for n, p in served_parameters(model).items()]
    return shape_mismatch(sent, expected, "the learner")
