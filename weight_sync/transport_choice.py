"""``sync.transport``, the one door to the transports: which one a role uses
(:func:`resolve_transport`, :func:`role_transport`) and, for the one chosen, the learner's
half (:func:`broadcast_for`: the data plane the sender hands each version to) and the
rollout engine's (:func:`receiver_for`, :func:`transfer_backend`).

- ``gloo``: the weights travel in the gloo group's buckets (weight_sync/sender.py), and
  the engine stages them in its worker process (weight_sync/stager.py): no data plane,
  no receiver in the server's process, no vLLM transfer engine.
- under ``learner.lora``, gloo whatever the machine: a version is an adapter
  (:func:`resolve_transport`).
- ``nccl`` (weight_sync/nccl.py) and ``ipc`` (weight_sync/ipc.py): gloo stays the control
  plane; the learner broadcasts with :class:`~weight_sync.nccl.NcclBroadcast` or
  :class:`~weight_sync.ipc.IpcBroadcast`, and the engine receives with
  :class:`~weight_sync.device_updates.DeviceUpdates` driving vLLM's transfer engine of
  that name.

The learner (learner/channels.py) and the rollout engine (rollout_service/engine.py) ask
here and never branch on the transport themselves, so a new transport touches weight_sync/
only (and its vLLM binding, if it needs a new call).
"""

from __future__ import annotations

from typing import Callable

import torch

from rlpipe.config import ConfigError, RunConfig
from weight_sync.device_updates import DeviceUpdates, TransferEngine
from weight_sync.ipc import IpcBroadcast
from weight_sync.names import checkpoint_shapes
from weight_sync.nccl import NcclBroadcast

TRANSPORTS = ("auto", "gloo", "nccl", "ipc")
DEVICE_TRANSPORTS = ("nccl", "ipc")  # vLLM's weight-transfer engines (weight_sync/device_updates.py), CUDA only


def resolve_transport(requested: str, cuda_devices: int, adapters: bool = False) -> str:
    """The transport a process uses for ``sync.transport``: ``auto`` is NCCL where CUDA is
    present and gloo (staged in host memory) where it is not (a launch that knows where
    every role runs refines it: launch.gpus.plan_transport). Raises ValueError, naming
    the key, for a transport this machine cannot run.

    ``adapters`` (``learner.lora``): a version is an adapter, and ``auto`` is gloo on every
    machine. The base never travels (each worker loads it once), and an adapter is small
    (4.9 MB at rank 8 on SmolLM2), so the gloo buckets that carry every transport's headers
    carry it too; vLLM's transfer engines behind nccl and ipc write into the base's weights,
    not into LoRA slots, so those two are refused, naming why."""
    if requested not in TRANSPORTS:
        raise ValueError(f"sync.transport: {requested!r} is not one of {', '.join(TRANSPORTS)}")
    if adapters and requested in DEVICE_TRANSPORTS:
        raise ValueError(f"sync.transport: {requested} loads whole versions into the engines' base weights "
                         f"(vLLM's transfer engine), and under learner.lora a version is its adapter, which "
                         f"travels over gloo with the versions' headers; use auto or gloo")
    if adapters:
        return "gloo"
    if requested == "auto":
        return "nccl" if cuda_devices else "gloo"
    if requested in DEVICE_TRANSPORTS and not cuda_devices:
        what = ("moves weights between CUDA devices" if requested == "nccl" else
                "shares the learner's CUDA memory with an engine on its GPU")
        raise ValueError(f"sync.transport: {requested} {what} and this machine has none (use auto or gloo)")
    return requested


def resolve_for_config(requested: str, n_devices: int, adapters: bool = False) -> str:
    """:func:`resolve_transport`, refusing with the ConfigError a launch reports."""
    try:
        return resolve_transport(requested, n_devices, adapters)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cuda_devices() -> int:
    """How many CUDA devices this process sees (0 on a machine without any)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def role_transport(cfg: RunConfig) -> str:
    """The transport this role uses: ``sync.transport`` resolved on this machine (a role that
    ``rlpipe demo`` or ``up`` started gets their resolution in its environment)."""
    return resolve_for_config(cfg.sync.transport, cuda_devices(), adapters=cfg.learner.lora.rank > 0)


def broadcast_for(transport: str, bucket_bytes: int, timeout_s: float) -> NcclBroadcast | IpcBroadcast | None:
    """The learner's half of a resolved ``transport``: the data plane its
    :class:`~weight_sync.sender.WeightSender` hands each version to (its ``device``), or
    None under gloo, where the sender's gloo buckets carry the weights themselves."""
    if transport == "nccl":
        return NcclBroadcast(bucket_bytes, timeout_s)
    if transport == "ipc":
        return IpcBroadcast(timeout_s)
    return None


def transfer_backend(transport: str) -> str | None:
    """The rollout engine's weight-transfer backend for a resolved ``transport`` (vLLM's
    ``weight_transfer_config``), or None under gloo, whose receiver is rlpipe's stager in the
    engine's worker process."""
    return transport if transport in DEVICE_TRANSPORTS else None


def receiver_for(transport: str, engine: Callable[[], TransferEngine], model_dir: str, quant_compat: str,
                 engine_ranks: int) -> DeviceUpdates | None:
    """The rollout engine's half of a resolved ``transport``, run in the rollout server's
    process: under nccl and ipc the :class:`~weight_sync.device_updates.DeviceUpdates` that
    joins each generation and drives ``engine()`` (the engine's transfer engine, made only
    here), checking manifests against ``model_dir``'s checkpoint shapes and ``quant_compat``;
    ``engine_ranks``: the engine's processes. None under gloo: there the engine's worker
    process receives and stages each version (weight_sync/stager.py)."""
    if transfer_backend(transport) is None:
        return None
    return DeviceUpdates(engine(), transport, checkpoint_shapes(model_dir), quant_compat, engine_ranks)
