"""``sync.transport``, the one door to the transports: which one a role uses
(:func:`resolve_transport`, :func:`role_transport`) and, for the one chosen, the learner's
half (:func:`broadcast_for`: the data plane the sender hands each version to) and the
rollout engine's (:func:`receiver_for`, :func:`transfer_backend`).

Every rule here reads the transport's row of rlpipe/transports.py, never its name: what it
needs (CUDA), whom it reaches (by learner rank 0's GPU), whether it carries a LoRA version,
``auto``'s order, and its module.

- the staged transport (gloo): the weights travel in the gloo group's buckets
  (weight_sync/sender.py), and the engine stages them in its worker process
  (weight_sync/stager.py): no data plane, no receiver in the server's process, no vLLM
  transfer engine.
- under ``learner.lora``, a transport that carries adapters whatever the machine
  (:func:`resolve_transport`).
- a row with an ``engine_backend`` (nccl: weight_sync/nccl.py, ipc: weight_sync/ipc.py):
  gloo stays the control plane; the learner broadcasts with its module's ``broadcast``,
  and the engine receives with :class:`~weight_sync.device_updates.DeviceUpdates` driving
  vLLM's transfer engine of that name (weight_sync/device_plane.py).

The learner (learner/channels.py) and the rollout engine (rollout_service/engine.py) ask
here and never branch on the transport themselves, so a new transport is its module and its
row (and its vLLM binding, if it needs a new call).
"""

from __future__ import annotations

from typing import Callable

import torch

from rlpipe.config import ConfigError, RunConfig
from rlpipe.transports import AUTO, SPECS, TransportSpec, auto_order, either, spec
from weight_sync.device_plane import DeviceBroadcast, plane
from weight_sync.device_updates import DeviceUpdates, TransferEngine
from weight_sync.names import checkpoint_shapes

Placement = tuple[int, list[tuple[int, ...]]]  # learner rank 0's GPU, and each worker's GPUs


def resolve_transport(requested: str, cuda_devices: int, adapters: bool = False,
                      placement: Placement | None = None) -> str:
    """The transport a process uses for ``sync.transport``: ``auto`` is the first row, in
    its order, that fits; a named one is refused when it does not, naming the key and why.

    It fits when this machine has CUDA if it needs it, it reaches every worker of the
    ``placement`` (known to a launch that places every role, launch/gpus.py; a role alone
    does not check reach, and takes what the launch gave it), and, under ``learner.lora``
    (``adapters``), it carries adapters. The base never travels then (each worker loads it
    once), and an adapter is small (4.9 MB at rank 8 on SmolLM2), so the gloo buckets that
    carry every transport's headers carry it too; vLLM's transfer engines write into the
    base's weights, not into LoRA slots."""
    if requested == AUTO:
        return next(s.name for s in auto_order() if refusal(s, cuda_devices, adapters, placement) is None)
    row = spec(requested)  # a ValueError naming the key and every choice for an unknown one
    if not row.choosable:
        raise ValueError(f"sync.transport: {requested} is auto's to choose, not a setting")
    if why := refusal(row, cuda_devices, adapters, placement):
        raise ValueError(why)
    return requested


def refusal(row: TransportSpec, cuda_devices: int, adapters: bool, placement: Placement | None) -> str | None:
    """Why ``row`` cannot carry this run's versions, or None."""
    head = f"sync.transport: {row.name}"
    if adapters and not row.adapters:
        carriers = [s.name for s in SPECS.values() if s.adapters]
        return (f"{head} {row.no_adapters_why}, and under learner.lora a version is its adapter, which travels "
                f"over {either(carriers)} with the versions' headers; use {either([AUTO, *carriers])}")
    if row.cuda and not cuda_devices:
        return f"{head} {row.needs_cuda_why} and this machine has none (use {either([AUTO, *_others(row, False)])})"
    sender, slices = placement or (0, [])
    for worker, gpus in enumerate(slices):
        if not row.reaches(sender, gpus):
            where, fix = (("shares", "give them separate GPUs, or ") if sender in gpus else ("is not on", ""))
            return (f"{head} cannot reach worker {worker}, which {where} GPU {sender} with learner rank 0 "
                    f"({row.reach_why}); {fix}use {either(_others(row, True, sender, gpus))}")
    return None


def _others(row: TransportSpec, cuda: bool, sender: int = 0, gpus: tuple[int, ...] = ()) -> list[str]:
    """The other transports a refusal offers, in auto's order: those that run without CUDA,
    or (``cuda``) those that reach a worker on ``gpus``."""
    return [s.name for s in auto_order() if s is not row and s.choosable
            and (s.reaches(sender, gpus) if cuda else not s.cuda)]


def resolve_for_config(requested: str, n_devices: int, adapters: bool = False,
                       placement: Placement | None = None) -> str:
    """:func:`resolve_transport`, refusing with the ConfigError a launch reports."""
    try:
        return resolve_transport(requested, n_devices, adapters, placement)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cuda_devices() -> int:
    """How many CUDA devices this process sees (0 on a machine without any)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def role_transport(cfg: RunConfig) -> str:
    """The transport this role uses: ``sync.transport`` resolved on this machine (a role that
    ``rlpipe demo`` or ``up`` started gets their resolution in its environment)."""
    return resolve_for_config(cfg.sync.transport, cuda_devices(), adapters=cfg.learner.lora.rank > 0)


def broadcast_for(transport: str, bucket_bytes: int, timeout_s: float) -> DeviceBroadcast | None:
    """The learner's half of a resolved ``transport``: the data plane its
    :class:`~weight_sync.sender.WeightSender` hands each version to (its ``device``), or
    None for the staged transport, where the sender's gloo buckets carry the weights themselves."""
    module = plane(transport)
    return None if module is None else module.broadcast(bucket_bytes, timeout_s)


def transfer_backend(transport: str) -> str | None:
    """The rollout engine's weight-transfer backend for a resolved ``transport`` (vLLM's
    ``weight_transfer_config``), or None for the staged transport, whose receiver is rlpipe's
    stager in the engine's worker process."""
    return spec(transport).engine_backend


def receiver_for(transport: str, engine: Callable[[], TransferEngine], model_dir: str, quant_compat: str,
                 engine_ranks: int) -> DeviceUpdates | None:
    """The rollout engine's half of a resolved ``transport``, run in the rollout server's
    process: under a transport with a vLLM transfer engine, the
    :class:`~weight_sync.device_updates.DeviceUpdates` that joins each generation and drives
    ``engine()`` (the engine's transfer engine, made only here), checking manifests against
    ``model_dir``'s checkpoint shapes and ``quant_compat``; ``engine_ranks``: the engine's
    processes. None for the staged transport: there the engine's worker process receives
    and stages each version (weight_sync/stager.py)."""
    if transfer_backend(transport) is None:
        return None
    return DeviceUpdates(engine(), transport, checkpoint_shapes(model_dir), quant_compat, engine_ranks)
