"""Atomic learner checkpoints: a directory appears complete or not at all.

A checkpoint is ``<root>/step_00000010/``: the policy as a Hugging Face model directory
(safetensors, config and the tokenizer files, so vLLM or a returning worker can load it
as is), for each quantized rollout precision the tensors its workers load
(``rollout/<precision>/model.safetensors``, with the profile hash in ``quant.json``: a
returning int8 worker catches up on the learner's own quantization) plus ``trainer_state.pt`` (optimizer, LR schedule, loss scaler, RNG states,
counters, and the group ids trained since the previous checkpoint) and ``meta.json``.

The optimizer state is in one of two formats (``learner.checkpoint_format``). Full: inside
``trainer_state.pt``, gathered whole on rank 0 (the only one with one process). Sharded:
``optimizer/``, a ``torch.distributed.checkpoint`` (DCP) directory in which every rank
writes its own shard, so under FSDP no rank ever holds the whole Adam state (for a 7B
model about 56 GB in fp32); its ``trainer_state.pt`` holds the rest. Either loads on any
number of ranks (:func:`load_optimizer`). The weights are consolidated into the Hugging
Face directory in both, as rollout workers and vLLM load them from there.

It is written to a hidden temporary directory, every file and the directory are
fsynced, and only then is the directory renamed into place (``rename`` is atomic on
POSIX filesystems) and the parent fsynced. A crash at any point leaves either the
previous checkpoints or the new one, never half of one; leftover temporaries are
removed by the next save. The newest ``keep`` checkpoints are kept. Sharded, every rank
writes and fsyncs its shard files into rank 0's temporary directory, and DCP's save only
returns on rank 0 once every rank has reported its writes done (it gathers their results
before writing ``optimizer/.metadata``): rank 0 renames after that, so the shards are
durable before the directory appears.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from learner.dist import full
from learner.lora import is_lora
from rlpipe.checkpoints import PREFIX, complete, latest, read_meta  # noqa: F401 (the learner's API too)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


@dataclass
class RunCounters:
    """The learner's running counts, saved in every checkpoint and restored from it."""

    step: int = 0
    version: int = 0
    dropped_stale_total: int = 0
    groups_skipped_total: int = 0
    filtered_total: int = field(default_factory=int)  # groups with equal rewards settled untrained (dynamic sampling)
    sample_ratio: float = field(default_factory=lambda: 1.0)  # groups sampled per group trained, smoothed
    trained_groups: int = 0  # in the lineage of the current weights
    trained_digest: int = 0  # group_digest of their ids
    grad_norm_smoothed: float | None = None
    # Per rollout precision, a mixed fleet's share of the run (the same lineage as trained_groups)
    trained_by_precision: dict[str, int] = field(default_factory=dict)
    dropped_stale_by_precision: dict[str, int] = field(default_factory=dict)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint written before a field existed restores that field's default."""
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])
            elif f.default_factory is not MISSING:
                setattr(self, f.name, f.default_factory())
            else:
                raise KeyError(f"checkpoint counters lack {f.name!r}")


SHARDS = "optimizer"  # the sharded format's DCP directory inside a checkpoint


def snapshot(model, state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Copies in host memory of the model's weights and of the trainer state (the optimizer's
    tensors included), so a checkpoint can be written in the background while the next
    steps change the originals. Tied weights stay tied (one copy under both names).

    A sharded (FSDP) model's tensors are gathered whole, which is a collective: every rank
    must take the snapshot, of states with their sharded tensors in the same order; only
    rank 0 writes it."""
    return snapshot_weights(model), host_copy(state)


def snapshot_weights(model, keep: bool = True) -> dict[str, torch.Tensor]:
    """The weights part of :func:`snapshot`. Under FSDP a collective on every rank; a rank
    that does not write them (``keep`` false) drops each tensor once gathered, so it never
    holds the whole model."""
    copies: dict[int, torch.Tensor] = {}
    weights = {}
    adapter_only = is_lora(model)  # LoRA: the checkpoint holds the adapter, not the frozen base
    for name, t in model.state_dict(keep_vars=True).items():  # tied weights: one object
        if adapter_only and not t.requires_grad:
            continue
        if id(t) not in copies:
            whole = full(t.detach())  # under FSDP a collective, on every rank
            copies[id(t)] = whole.to("cpu", copy=True) if keep else None
        weights[name] = copies[id(t)]
    return weights if keep else {}


def host_copy(obj, whole: bool = True):
    """``obj`` (tensors in dicts, lists and tuples) with every tensor copied to host memory:
    whole (a sharded tensor gathered, a collective), or with ``whole`` false a sharded
    tensor's local shard only, still a DTensor so DCP knows where it belongs (a DTensor's
    ``to`` copies its local shard, as DCP's own async staging does)."""
    if isinstance(obj, torch.Tensor):
        return (full(obj.detach()) if whole else obj.detach()).to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v, whole) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, whole) for v in obj)
    return copy.deepcopy(obj)


def optimizer_shards(model, opt) -> dict:
    """This rank's part of the optimizer state in host memory, for :func:`save_shards`: under
    FSDP each state tensor's local shard (nothing is gathered), keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return host_copy(get_optimizer_state_dict(model, opt), whole=False)


def save_shards(path: Path, shards: dict, group=None) -> None:
    """Write :func:`optimizer_shards` as a DCP directory: every rank calls this with its own
    shards at once (a collective on ``group``); each writes and fsyncs its own files, and
    rank 0 returns only after every rank has (it then writes the ``.metadata`` file)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({SHARDS: shards}, checkpoint_id=path, process_group=group)


def load_optimizer(path: str | Path, state: dict, model, opt) -> None:
    """Load the optimizer state of checkpoint ``path`` (its ``trainer_state.pt`` is ``state``)
    into ``opt``, whichever format it was saved in and on however many ranks: DCP reshards
    the sharded format into this process's layout (the whole tensors in one process)."""
    path = Path(path)
    if "optimizer" in state:
        load_optimizer_state(model, opt, state["optimizer"])
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # The layout to load into; Adam's state, created lazily, is created here (a step at lr 0).
    target = get_optimizer_state_dict(model, opt)
    dcp.load({SHARDS: target}, checkpoint_id=path / SHARDS)
    set_optimizer_state_dict(model, opt, target)


def optimizer_state(model, opt) -> dict:
    """``opt.state_dict()`` keyed by parameter name instead of position, so a checkpoint
    loads whether it was saved by one process or by sharded ranks (:func:`load_optimizer_state`).
    Under FSDP its tensors are the rank's shards (DTensors): :func:`snapshot` gathers them."""
    order = [p for group in opt.param_groups for p in group["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    name = [names[id(p)] for p in order]
    sd = opt.state_dict()
    return {"state": {name[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in sd["param_groups"]]}


def load_optimizer_state(model, opt, state: dict) -> None:
    """Load an :func:`optimizer_state` (whole tensors) into ``opt``; each tensor shaped like
    its parameter is sharded like it (every rank holds the whole state and keeps its part)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    index = {id(p): i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}

    def like(value, param):
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape:
            return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        return value

    opt.load_state_dict({
        "state": {index[id(params[n])]: {k: like(v, params[n]) for k, v in s.items()} for n, s in state["state"].items()},
        "param_groups": [{**g, "params": [index[id(params[n])] for n in g["params"]]} for g in state["param_groups"]],
    })


def group_digest(group_ids) -> int:
    """An order-independent 64-bit digest of a multiset of group ids (the sum of their
    hashes mod 2**64): checkpoints carry it so a test, or an operator, can check that the
    run trained every group exactly once, without storing every id."""
    total = 0
    for gid in group_ids:
        total += int.from_bytes(hashlib.blake2b(gid.encode(), digest_size=8).digest(), "little")
    return total % (1 << 64)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(root: str | Path, step: int) -> Path:
    """A new, empty temporary directory for checkpoint ``step`` (one left by this process
    before is cleared): what :func:`save` fills, and where sharded ranks write their shards."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def save(root: str | Path, step: int, model, state: dict, meta: dict, tokenizer_dir: str | Path | None = None,
         keep: int = 2, before_publish: Callable[[], None] | None = None,
         rollout: dict[str, tuple[str, dict[str, torch.Tensor]]] | None = None,
         weights: dict[str, torch.Tensor] | None = None, tmp: Path | None = None) -> Path:
    """Write checkpoint ``step`` atomically; returns its directory. ``rollout`` maps a
    precision to ``(quant profile hash, tensors)`` of its workers' quantized weights (or a
    function making them from the whole weights, for a sharded learner);
    ``weights``, a :func:`snapshot` of the model's (default: the model's own tensors);
    ``tmp``, the :func:`begin` directory the optimizer's shards were written into (default: a new one)."""
    root = Path(root)
    final = root / f"{PREFIX}{step:08d}"
    tmp = tmp or begin(root, step)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
    if tokenizer_dir:
        # The tokenizer and the like; never the base model's weights (a shard named like one
        # save_pretrained just wrote would overwrite the trained weights) nor its config.
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and not (tmp / f.name).exists() and not f.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(f, tmp / f.name)
    for precision, (quant_profile, tensors, adapter) in (rollout or {}).items():
        from safetensors.torch import save_file

        if callable(tensors):  # a sharded learner's: made here from the gathered weights
            tensors = tensors(weights if weights is not None else dict(model.named_parameters()))
        sub = tmp / "rollout" / precision
        sub.mkdir(parents=True)
        # a LoRA run's: the adapter as its workers load it (weight_sync/adapters.py reads it back)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  sub / ("adapter_model.safetensors" if adapter else "model.safetensors"))
        if adapter:
            (sub / "adapter_config.json").write_text(adapter)
        (sub / "quant.json").write_text(json.dumps({"quant_profile": quant_profile}))
        for f in sub.iterdir():
            _fsync(f)
        _fsync(sub)
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
    for f in tmp.rglob("*"):  # the shards and their directory too (already fsynced by each rank)
        _fsync(f)
    _fsync(tmp)
    if before_publish:
        before_publish()
    if final.exists():  # the same step saved again (a resumed run that stopped at once)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    for old in complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(f".tmp-{PREFIX}*"):
        if not tmp.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)


def load_state(path: str | Path) -> dict:
    return torch.load(Path(path) / "trainer_state.pt", weights_only=False)
