"""Packing weights into flat, dtype-homogeneous buckets, and the manifest that unpacks them.

The sender copies every tensor into a few large byte buffers (one collective per bucket
instead of one per parameter); the receiver gets the same buffers and takes zero-copy
views of each tensor. The manifest (name, dtype, shape, offset per tensor) travels as
JSON through Redis; its hash lets both sides check they agree on the layout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

# The unit of pipelining inside a bucket (see segments).
SEGMENT_BYTES = 8 << 20

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "int32": torch.int32,
    "uint8": torch.uint8,
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
    segment_bytes: int = SEGMENT_BYTES  # pieces each bucket travels in (see segments)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_json(self) -> str:
        return json.dumps({"segment_bytes": self.segment_bytes, "buckets": [asdict(b) for b in self.buckets]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        buckets = []
        for b in data["buckets"]:
            slots = tuple(TensorSlot(t["name"], tuple(t["shape"]), t["offset"], t["nbytes"]) for t in b["tensors"])
            buckets.append(Bucket(b["dtype"], b["nbytes"], slots))
        return cls(tuple(buckets), data["segment_bytes"])

    def pieces(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """The messages an update travels in, in order: slices of the bucket buffers."""
        return [buf[start:end] for bucket, buf in zip(self.buckets, buffers)
                for start, end, _ in segments(bucket, self.segment_bytes)]

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def plan_buckets(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int,
                 segment_bytes: int = SEGMENT_BYTES) -> Manifest:
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
    return Manifest(tuple(buckets), segment_bytes)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def segments(bucket: Bucket, min_bytes: int) -> list[tuple[int, int, tuple[TensorSlot, ...]]]:
    """Split a bucket at tensor boundaries into pieces of at least ``min_bytes`` (the last
    may be smaller): ``(start, end, slots)``. A piece is what the sender packs and sends
    while the previous one is on the wire, so even a model that fits in one bucket has
    its packing hidden behind the transfer. Both sides derive the same pieces."""
    pieces, start, slots = [], 0, []
    for slot in bucket.tensors:
        slots.append(slot)
        end = slot.offset + slot.nbytes
        if end - start >= min_bytes:
            pieces.append((start, end, tuple(slots)))
            start, slots = end, []
    if slots:
        pieces.append((start, bucket.nbytes, tuple(slots)))
    return pieces


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None,
                slots: tuple[TensorSlot, ...] | None = None) -> torch.Tensor:
    """Copy the bucket's tensors (or just ``slots``), cast to its dtype, into one uint8 buffer."""
    dtype = DTYPES[bucket.dtype]
    if out is None:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for slot in bucket.tensors if slots is None else slots:
        src = tensors[slot.name].detach()
        view = out[slot.offset : slot.offset + slot.nbytes].view(dtype).view(slot.shape)
        view.copy_(src)  # casts to the wire dtype where the source differs
    return out


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors into ``buffer`` (no copies)."""
    dtype = DTYPES[bucket.dtype]
    return [
        (slot.name, buffer[slot.offset : slot.offset + slot.nbytes].view(dtype).view(slot.shape))
        for slot in bucket.tensors
    ]


def incompatibility(manifest: Manifest, expected: dict[str, tuple[int, ...]]) -> str | None:
    """Why ``manifest`` cannot load into a model whose tensors have the ``expected``
    shapes (a learner that trains another model than the worker serves), or None."""
    for bucket in manifest.buckets:
        for slot in bucket.tensors:
            if slot.name not in expected:
                return f"the learner sends {slot.name!r}, which this worker's model does not have"
            if tuple(expected[slot.name]) != slot.shape:
                return f"{slot.name}: the learner sends shape {list(slot.shape)}, this worker's model has {list(expected[slot.name])}"
    return None
