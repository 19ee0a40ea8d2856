"""Each weight-sync transport (``sync.transport``), defined once.

A transport is one row of :data:`SPECS`. Every rule about a transport reads its row rather
than naming it: the config's allowed values (:data:`Choice`) and description, ``auto``'s
choice and the refusal of a transport the machine, the placement or a LoRA run cannot use
(weight_sync/transport_choice.py, for a role alone and for a launch that knows every role's
GPUs), the engine arguments it allows (rollout_service/engine_args.py), the rollout engine's
vLLM weight-transfer backend, and which module carries the bytes (weight_sync/device_plane.py
imports the row's ``module``). docs/weight-sync.md shows the table, and tests/test_transports.py
fails when the two differ. Adding a transport is a row here and its module: no other list of
transports exists to forget.

Kept free of heavy imports (no torch, no pydantic): the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AUTO = "auto"  # the choice that is no transport: the first row, in auto's order, that fits


@dataclass(frozen=True)
class TransportSpec:
    name: str  # sync.transport's value, and the manifest's ``transport``
    summary: str  # how a version travels, in a few words (the config's description, the docs)
    memory: Literal["host", "gpu"]  # where the weights travel from and to: staged in host memory, or GPU memory
    hosts: Literal["across", "one GPU"]  # reaches workers on other hosts, or only on the sender's own GPU
    # Which workers it reaches, by learner rank 0's GPU (the sender's): any; only those off it
    # (NCCL places one rank per GPU); only those on it (a CUDA IPC handle maps on one GPU).
    reach: Literal["any", "off sender", "on sender"]
    cuda: bool  # needs CUDA devices on the learner and the workers
    carrier: str  # what moves the bytes: a torch.distributed backend, or CUDA IPC handles
    # vLLM's ``weight_transfer_config`` backend that receives it in the engine; None: rlpipe's
    # stager in the engine's worker process takes the gloo buckets (weight_sync/stager.py).
    engine_backend: str | None
    adapters: bool  # carries a learner.lora version (an adapter, not the base's weights)
    sharded_engines: bool  # feeds an engine of several processes (tensor or pipeline parallel)
    auto: int | None  # auto's order of preference (lowest first); None: only when named
    module: str  # the module that implements it (device_plane.py imports it when engine_backend is set)
    choosable: bool = True  # a user may name it in sync.transport
    # Why it is refused, completing "sync.transport: <name> ..." (empty where it never is):
    needs_cuda_why: str = ""  # "... <why> and this machine has none"
    reach_why: str = ""  # "... cannot reach worker i, which ... (<why>)"
    no_adapters_why: str = ""  # "... <why>, and under learner.lora a version is its adapter"
    one_process_why: str = ""  # "under <name> <why>": an engine must be one process

    def reaches(self, sender_gpu: int, gpus: tuple[int, ...]) -> bool:
        """Whether a worker on ``gpus`` is reached from learner rank 0 on ``sender_gpu``."""
        return self.reach == "any" or (sender_gpu in gpus) == (self.reach == "on sender")


SPECS: dict[str, TransportSpec] = {s.name: s for s in (
    TransportSpec("gloo", "staged in host memory, any device", "host", "across", "any", cuda=False,
                  carrier="gloo", engine_backend=None, adapters=True, sharded_engines=False, auto=2,
                  module="weight_sync.sender",
                  one_process_why="the weight follower receives updates in one engine process"),
    TransportSpec("nccl", "GPU to GPU", "gpu", "across", "off sender", cuda=True, carrier="nccl",
                  engine_backend="nccl", adapters=False, sharded_engines=True, auto=0, module="weight_sync.nccl",
                  needs_cuda_why="moves weights between CUDA devices",
                  reach_why="NCCL needs one GPU per rank",
                  no_adapters_why="loads whole versions into the engines' base weights (vLLM's transfer engine)"),
    TransportSpec("ipc", "CUDA IPC to engines on the learner's first GPU", "gpu", "one GPU", "on sender", cuda=True,
                  carrier="CUDA IPC", engine_backend="ipc", adapters=False, sharded_engines=False, auto=1,
                  module="weight_sync.ipc",
                  needs_cuda_why="shares the learner's CUDA memory with an engine on its GPU",
                  reach_why="CUDA IPC shares memory on one GPU",
                  no_adapters_why="loads whole versions into the engines' base weights (vLLM's transfer engine)",
                  one_process_why="the learner's buffer is shared from its one GPU, which the engine's other "
                                  "processes are not on"),
)}
TRANSPORTS: tuple[str, ...] = tuple(SPECS)
CHOICES: tuple[str, ...] = (AUTO, *(s.name for s in SPECS.values() if s.choosable))
Choice = Literal[CHOICES]  # the config's type: pydantic refuses any other value, naming the key
# The one transport without a data plane of its own: versions travel in the gloo group's
# buckets, which every transport uses for headers. A role that cannot resolve falls back to
# it, and a manifest without a ``transport`` field is its (what every manifest was before).
STAGED: str = next(s.name for s in SPECS.values() if s.engine_backend is None)


def spec(name: str) -> TransportSpec:
    """The row of ``name``; a ValueError naming the key for any other value."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"sync.transport: {name!r} is not one of {', '.join(CHOICES)}") from None


def auto_order() -> list[TransportSpec]:
    """The rows ``auto`` may pick, most preferred first."""
    return sorted((s for s in SPECS.values() if s.auto is not None), key=lambda s: s.auto)


def either(names) -> str:
    """``a``, ``a or b``, ``a, b or c``: the alternatives a refusal offers."""
    names = list(names)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


WHERE = {"any": "", "off sender": "no worker shares the learner's first GPU",
         "on sender": "every worker shares the learner's first GPU"}


def fits(s: TransportSpec) -> str:
    """Where ``auto`` picks ``s`` (over the rows after it), in words: "" = anywhere."""
    return " and ".join(w for w in ("CUDA is present" if s.cuda else "", WHERE[s.reach]) if w)


def describe() -> str:
    """``sync.transport``'s description, from the rows."""
    rows = ", ".join(f"{s.name} ({s.summary})" for s in SPECS.values() if s.choosable)
    picks = ", ".join(f"{s.name} where {fits(s)}" if fits(s) else f"else {s.name}" for s in auto_order())
    lora = [s.name for s in SPECS.values() if s.adapters]
    return (f"how versions travel: {rows}; {AUTO} = {picks}; under learner.lora, {either(lora)} (a version is "
            f"its adapter); docs/weight-sync.md has the table")
