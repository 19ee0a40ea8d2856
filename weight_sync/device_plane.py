"""The seam of a transport with a data plane of its own: a row of rlpipe/transports.py whose
``engine_backend`` names vLLM's weight-transfer engine (nccl, ipc). The module its row names
provides both halves under the three names of :class:`DevicePlane`, and nothing else
branches on which transport it is: the learner's sender drives a :class:`DeviceBroadcast`
(weight_sync/sender.py), the rollout engine's receiver the two engine calls
(weight_sync/device_updates.py). A new transport of this kind is its module and its row.

gloo, the staged transport, has none: its versions travel in the gloo group's buckets that
carry every transport's headers (weight_sync/sender.py, weight_sync/stager.py).
"""

from __future__ import annotations

import importlib
from typing import Awaitable, Callable, Iterable, Mapping, Protocol

from rlpipe.transports import spec


class DeviceBroadcast(Protocol):
    """The learner's half, one generation long: the sender's ``device``."""

    transport: str  # the row's name, which the manifest carries

    def open(self, group, rule=None) -> dict[int, str]:
        """After the gloo generation formed: join each member; those that did not (rank -> why)."""

    def broadcast(self, manifest, tensors: Mapping, gather: Callable | None,
                  ranks: Iterable[int] | None = None) -> dict[int, str]:
        """One version to ``ranks`` (every member's by default); those that failed (rank -> why)."""

    def abandon(self, rank: int) -> None:
        """Give up on one member, the others untouched."""

    def close(self) -> None:
        """Leave the generation."""


class DevicePlane(Protocol):
    """What the module of a row with an ``engine_backend`` provides."""

    def broadcast(self, bucket_bytes: int, timeout_s: float) -> DeviceBroadcast:
        """The learner's half, with buffers of ``bucket_bytes`` where it packs."""

    async def engine_init_info(self, group, engine_ranks: int) -> dict:
        """A member's init info for vLLM's transfer engine, after the generation formed."""

    async def engine_receive(self, group, manifest, load: Callable[[dict], Awaitable]) -> None:
        """After a version's header: its bytes into the engine, through ``load`` (vLLM's
        ``update_weights``) once or more."""


def plane(transport: str) -> DevicePlane | None:
    """The module of a resolved ``transport``'s data plane, or None for the staged one."""
    row = spec(transport)
    return None if row.engine_backend is None else importlib.import_module(row.module)
