"""The LoRA versions a rollout engine serves (``learner.lora``): one vLLM adapter per version.

The engine starts with ``enable_lora`` (:func:`lora_engine_kwargs`) and holds its base for
good; each version the learner sends is an adapter, written to a directory of its own
(weight_sync/adapters.py) and added under a new id (:meth:`AdapterVersions.adopt`). New
requests carry the newest; a request keeps the adapter it started with to its end, so a
group in flight finishes on its version and its per-token versions are its start's. An
adapter no request holds any more is removed, with its directory (:meth:`retire`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from weight_sync.adapters import remove_adapter

log = logging.getLogger(__name__)

# The ranks vLLM's LoRA config accepts (vllm/config/lora.py MaxLoRARanks).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraServe:
    """What a worker's engine is started with for adapters."""

    rank: int  # learner.lora.rank
    max_loras: int  # adapters one batch may mix: a version and those of groups still in flight
    max_cpu_loras: int  # adapters held at once (vLLM reloads an evicted one from its directory)


def lora_serve(cfg) -> LoraServe | None:
    """The run's adapter serving, None without ``learner.lora``. A batch mixes the current
    version and the ones in-flight groups started on: ``queue.max_lag`` + 1 (issue 35, as
    TRL sizes ``max_loras``), and up to ``queue.max_staleness`` + 1 are held, the hard bound
    on how old a group in flight gets."""
    if not cfg.learner.lora.rank:
        return None
    max_loras = cfg.queue.max_lag + 1
    return LoraServe(cfg.learner.lora.rank, max_loras, max(max_loras, cfg.queue.staleness_bound + 1))


def lora_engine_kwargs(lora: LoraServe | None) -> dict:
    if lora is None:
        return {}
    rank = next(r for r in VLLM_RANKS if r >= lora.rank)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": lora.max_loras,
            "max_cpu_loras": lora.max_cpu_loras}


class AdapterVersions:
    """Version -> its adapter (vLLM's ``LoRARequest`` and directory) in one engine."""

    def __init__(self):
        self.current = None  # the LoRARequest new requests carry (None: the base alone)
        self._held: dict[int, tuple[object, str]] = {}
        self._root: str | None = None  # the engine process's directory of versions

    @property
    def versions(self) -> list[int]:
        """The versions whose adapters are held: the current one and those requests in flight started on."""
        return sorted(self._held)

    async def adopt(self, llm, version: int, path: str) -> None:
        """Load ``version``'s adapter from ``path`` under a new id; new requests carry it from here."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"rlpipe-v{version}", version + 1, path)  # ids start at 1
        if not await llm.add_lora(request):
            raise RuntimeError(f"vLLM did not add the adapter of version {version} ({path})")
        self._held[version] = (request, path)
        self.current = request
        self._root = str(Path(path).parent)

    async def retire(self, llm, in_use: set[int]) -> int:
        """Remove every adapter but the current one and those of ``in_use`` versions; returns how many."""
        current = self.current.lora_int_id - 1 if self.current is not None else None
        gone = [v for v in self._held if v != current and v not in in_use]
        for v in gone:
            request, path = self._held.pop(v)
            await llm.remove_lora(request.lora_int_id)
            remove_adapter(path)
        return len(gone)

    def close(self) -> None:
        """Every version's directory, and theirs, gone with the engine."""
        for _, path in self._held.values():
            remove_adapter(path)
        self._held.clear()
        if self._root is not None:
            remove_adapter(self._root)
