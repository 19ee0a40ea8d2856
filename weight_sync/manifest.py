"""Packing weights into flat, dtype-homogeneous buckets, and the manifest that unpacks them.

The sender copies every tensor into a few large byte buffers (one collective per bucket
instead of one per parameter); the receiver gets the same buffers and takes zero-copy
views of each tensor. The manifest (name, dtype, shape, offset per tensor, and the
quantization the tensors carry) travels as JSON through Redis; its hash lets both sides
check they agree on the layout, and every transfer starts with a header naming it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Iterable

import torch

from rlpipe.transports import STAGED

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int16": torch.int16,  # the gaps of a delta (weight_sync/delta.py)
    "int64": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of its bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    dtype: str
    nbytes: int
    tensors: tuple[TensorSlot, ...]


@dataclass(frozen=True)
class Manifest:
    buckets: tuple[Bucket, ...]
    quant_profile: str = ""  # hash of the quantization profile the tensors were made with ("" = none)
    quant_compat: str = ""  # what an engine must have been started for to load them (quant/quant_profile.py)
    transport: str = STAGED  # how versions travel: a row of rlpipe/transports.py (the staged one: in the buckets)
    delta: bool = False  # versions after the first of a generation may travel as deltas (weight_sync/delta.py)
    chunk_bytes: int = 0  # gloo sends a whole version in chunks of this many bytes (0: a bucket a send)
    # a LoRA adapter's peft adapter_config.json: the tensors are the adapter alone, for the base the
    # worker already holds (learner.lora; weight_sync/adapters.py); "" = the model's own weights
    adapter: str = ""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_json(self) -> str:
        data = {"buckets": [asdict(b) for b in self.buckets], "quant_profile": self.quant_profile,
                "quant_compat": self.quant_compat}
        if self.transport != STAGED:  # the staged transport's manifests read as they always did
            data["transport"] = self.transport
        if self.delta:
            data["delta"] = True
        if self.chunk_bytes:
            data["chunk_bytes"] = self.chunk_bytes
        if self.adapter:
            data["adapter"] = self.adapter
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        buckets = []
        for b in data["buckets"]:
            slots = tuple(TensorSlot(t["name"], tuple(t["shape"]), t["offset"], t["nbytes"]) for t in b["tensors"])
            buckets.append(Bucket(b["dtype"], b["nbytes"], slots))
        return cls(tuple(buckets), data.get("quant_profile", ""), data.get("quant_compat", ""),
                   data.get("transport", STAGED), data.get("delta", False), data.get("chunk_bytes", 0),
                   data.get("adapter", ""))

    @cached_property  # a manifest is frozen: its hash is computed once, not at every check
    def hash(self) -> str:
        return manifest_hash(self.to_json())


def manifest_hash(text: str) -> str:
    """The hash of a manifest's JSON as the learner publishes it (:meth:`Manifest.to_json`).
    A worker checks the sync hash's ``manifest`` against its ``manifest_hash`` with it,
    before parsing or signing anything: either field can be rewritten in Redis without the
    sync token, and a worker that signed its check-in for the learner's hash but judged a
    rewritten manifest would answer the learner about weights it never sent."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def refusal(manifest: Manifest, why: str) -> str:
    """What a worker writes at its check-in to refuse ``manifest``: why, after the hash of
    the manifest it judged. A refusal stops the learner only if it names the learner's own
    manifest (weight_sync/sender.py): one of a manifest rewritten in Redis must not."""
    return f"manifest {manifest.hash}: {why}"


def refused_manifest(answer: str) -> tuple[str, str]:
    """A check-in's refusal (:func:`refusal`) as ``(hash of the manifest refused, why)``;
    ``("", answer)`` for one that names no manifest."""
    m = re.fullmatch(r"manifest ([0-9a-f]{16}): (.*)", answer, re.S)
    return (m[1], m[2]) if m else ("", answer)


HEADER_LEN = 4


def header_tensor(version: int, manifest_hash: str, base: int = -1, index_nbytes: int = 0) -> torch.Tensor:
    """What every transfer starts with: its version, (part of) its manifest's hash, and for
    a delta version the version it applies to and its index's size (-1 and 0: the buckets
    follow whole)."""
    return torch.tensor([version, int(manifest_hash[:15], 16), base, index_nbytes], dtype=torch.int64)


def plan_buckets(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int, quant_profile: str = "",
                 quant_compat: str = "", transport: str = STAGED, delta: bool = False,
                 chunk_bytes: int = 0, adapter: str = "") -> Manifest:
    """Group tensors by dtype, in the given order, into buckets of at most ``bucket_bytes``.

    A tensor larger than a bucket gets a bucket of its own (of its size), so every tensor
    stays contiguous and unpacks as a view.
    """
    by_dtype: dict[torch.dtype, list] = {}
    for name, dtype, shape in specs:
        by_dtype.setdefault(dtype, []).append((name, tuple(shape)))
    buckets = []
    for dtype, items in by_dtype.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        slots, used = [], 0
        for name, shape in items:
            nbytes = itemsize * _numel(shape)
            if slots and used + nbytes > bucket_bytes:
                buckets.append(Bucket(dtype_name(dtype), used, tuple(slots)))
                slots, used = [], 0
            slots.append(TensorSlot(name, shape, used, nbytes))
            used += nbytes
        if slots:
            buckets.append(Bucket(dtype_name(dtype), used, tuple(slots)))
    return Manifest(tuple(buckets), quant_profile, quant_compat, transport, delta, chunk_bytes, adapter)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the bucket's tensors (cast to its dtype) into one uint8 buffer."""
    dtype = DTYPES[bucket.dtype]
    if out is None:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for slot in bucket.tensors:
        src = tensors[slot.name].detach()
        view = out[slot.offset : slot.offset + slot.nbytes].view(dtype).view(slot.shape)
        view.copy_(src)  # casts to the wire dtype where the source differs
    return out


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, end)`` of bucket ``bucket``: one send of a version over gloo."""

    bucket: int
    start: int
    end: int


def chunks(manifest: Manifest) -> list[Chunk]:
    """How a whole version travels over gloo: every bucket cut into ``chunk_bytes`` pieces
    (whole buckets without), in order. Chunk ``j`` goes with tag ``j + 1`` (the header has
    tag 0). Small sends let the sender pack a piece while the one before is on the wire,
    so packing hides behind the transfer even for a model of one bucket."""
    out = []
    for i, b in enumerate(manifest.buckets):
        step = manifest.chunk_bytes or b.nbytes
        out += [Chunk(i, start, min(start + step, b.nbytes)) for start in range(0, b.nbytes, step)]
    return out


def chunk_ring(manifest: Manifest, most: int) -> list[torch.Tensor]:
    """The buffers a whole version's :func:`chunks` are packed into in turn: ``most`` chunks
    in flight, but never more bytes than two whole buckets (what a bucket-by-bucket pipeline
    holds: a sharded learner's memory is measured by it)."""
    spans = chunks(manifest)
    largest = max((c.end - c.start for c in spans), default=0)
    two_buckets = 2 * max((b.nbytes for b in manifest.buckets), default=0)
    ring = min(most, len(spans), max(2, two_buckets // max(largest, 1)))
    return [torch.empty(largest, dtype=torch.uint8) for _ in range(ring)]


def pack_chunk(bucket: Bucket, chunk: Chunk, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy the parts of the bucket's tensors that fall in ``chunk`` (cast to the bucket's
    dtype) into ``out``, a uint8 buffer of the chunk's size. A chunk's bounds are multiples
    of the dtype's size, as every tensor's offset is."""
    dtype = DTYPES[bucket.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for slot in bucket.tensors:
        lo, hi = max(chunk.start, slot.offset), min(chunk.end, slot.offset + slot.nbytes)
        if lo >= hi:
            continue
        src = tensors[slot.name].detach().reshape(-1)
        dst = out[lo - chunk.start: hi - chunk.start].view(dtype)
        dst.copy_(src[(lo - slot.offset) // itemsize: (hi - slot.offset) // itemsize])


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors into ``buffer`` (no copies)."""
    dtype = DTYPES[bucket.dtype]
    return [
        (slot.name, buffer[slot.offset : slot.offset + slot.nbytes].view(dtype).view(slot.shape))
        for slot in bucket.tensors
    ]


def incompatibility(manifest: Manifest, expected: dict[str, tuple[int, ...]], quant_compat: str = "",
                    transport: str = STAGED, quant_profile: str = "", lora_rank: int = 0) -> str | None:
    """Why ``manifest`` cannot load into a model whose tensors have the ``expected``
    shapes and whose engine was started for quantization ``quant_compat`` (profile
    ``quant_profile``) and weight ``transport`` (a learner that trains another model,
    quantizes for another scheme or base model, or sends over another transport), or None.
    An adapter needs an engine started for adapters of its rank (``lora_rank``) and, on a
    quantized base, made for that base's very profile (weight_sync/adapters.py)."""
    if manifest.adapter:
        from weight_sync.adapters import adapter_incompatibility

        return adapter_incompatibility(manifest, expected, quant_compat, transport, quant_profile, lora_rank)
    if manifest.transport != transport:
        return (f"the learner sends over {manifest.transport}, this worker's engine was started for {transport} "
                f"(sync.transport must resolve alike on both: set it explicitly)")
    if manifest.quant_compat != quant_compat:
        return (f"the learner sends weights quantized as {manifest.quant_compat or 'unquantized'} "
                f"(profile {manifest.quant_profile or '-'}), this worker's engine was started for "
                f"{quant_compat or 'unquantized weights'}")
    return shape_mismatch(((slot.name, slot.shape) for b in manifest.buckets for slot in b.tensors), expected,
                          "the learner")


def shape_mismatch(shapes: Iterable[tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]],
                   source: str) -> str | None:
    """Why tensors of these ``(name, shape)`` from ``source`` do not fit a model with the
    ``expected`` shapes (an unknown name, a different shape), or None."""
    for name, shape in shapes:
        if name not in expected:
            return f"{source} sends {name!r}, which this worker's model does not have"
        if tuple(expected[name]) != tuple(shape):
            return f"{name}: {source} sends shape {list(shape)}, this worker's model has {list(expected[name])}"
    return None
