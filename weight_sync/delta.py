"""A version as its buckets' changes: what a delta sync sends instead of the buckets.

Within one sync generation every member keeps the last version's packed buckets (the
receiver's buffers, weight_sync/receiver.py) and the sender keeps the same bytes, so the
next version can travel as each bucket's change against them (weight_sync/delta_codec.py: per bucket
the smallest of dense, sparse, bitmap and their one-step sign forms; buckets are
dtype-homogeneous, so a bucket is one flat tensor of its dtype). This pays for quantized
wires, where most int8 values keep their value from one update to the next; bf16 values
almost all move, so those channels never send deltas (learner/channels.py).

On the wire a delta version is its header (weight_sync/manifest.py ``header_tensor``, with
the base version and the index's size), the index (JSON: per bucket, the delta's header
and its parts' dtypes and lengths) and one payload per bucket (its parts' bytes, one after
the other, each from a multiple of 8 bytes). Each bucket's delta carries CRC-32s of its base and of its result, so a member
that holds anything else (a missed version, corrupted memory) refuses it before writing,
and a wrong result is caught after; either way it leaves the generation and rejoins, which
brings it a full version.
"""

from __future__ import annotations

import json

import torch

from weight_sync.delta_codec import Delta, DeltaMismatch, apply_, checksum, encode
from weight_sync.manifest import DTYPES, Manifest

ALIGN = 8  # each part of a payload starts at a multiple of this, so it views as its dtype in place


def _flat(buf: torch.Tensor, dtype: str) -> torch.Tensor:
    return buf.view(DTYPES[dtype])


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _part_bytes(dtype: str, n: int) -> int:
    return n * torch.empty((), dtype=DTYPES[dtype]).element_size()


def bucket_checksums(buffers: list[torch.Tensor]) -> list[int]:
    return [checksum(b) for b in buffers]


def encode_version(manifest: Manifest, held: list[torch.Tensor], new: list[torch.Tensor],
                   held_crcs: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """``new``'s packed buckets as deltas against ``held``'s: ``(index, payloads, new crcs)``,
    the index a uint8 tensor of JSON, one uint8 payload per bucket."""
    entries, payloads, crcs = [], [], []
    for bucket, old, cur, crc in zip(manifest.buckets, held, new, held_crcs):
        d = encode(_flat(old, bucket.dtype), _flat(cur, bucket.dtype), base_crc=crc)
        parts = [(k, t.contiguous()) for k, t in d.tensors.items()]
        entries.append({"header": d.header(), "parts": [[k, str(t.dtype).removeprefix("torch."), t.numel()]
                                                        for k, t in parts]})
        payload = torch.zeros(sum(_padded(t.numel() * t.element_size()) for _, t in parts), dtype=torch.uint8)
        at = 0
        for _, t in parts:
            raw = t.reshape(-1).view(torch.uint8)
            payload[at: at + raw.numel()] = raw
            at += _padded(raw.numel())
        payloads.append(payload)
        crcs.append(d.new_crc)
    index = torch.frombuffer(bytearray(json.dumps(entries, separators=(",", ":")).encode()), dtype=torch.uint8)
    return index, payloads, crcs


def payload_sizes(index: torch.Tensor) -> list[int]:
    """Each bucket's payload bytes, from the index (what a receiver posts its receives for)."""
    return [sum(_padded(_part_bytes(dt, n)) for _, dt, n in e["parts"]) for e in _entries(index)]


def _entries(index: torch.Tensor) -> list[dict]:
    return json.loads(bytes(index.numpy()).decode())


def apply_version(manifest: Manifest, buffers: list[torch.Tensor], crcs: list[int], index: torch.Tensor,
                  payloads: list[torch.Tensor]) -> list[int]:
    """Turn the held buckets (``buffers``, whose checksums are ``crcs``) into the new
    version in place; returns the new checksums. Raises DeltaMismatch, having written
    nothing, when any bucket's base differs from what is held."""
    entries = _entries(index)
    if len(entries) != len(manifest.buckets):
        raise DeltaMismatch(f"a delta of {len(entries)} buckets for a manifest of {len(manifest.buckets)}")
    deltas = []
    for i, (bucket, entry, payload) in enumerate(zip(manifest.buckets, entries, payloads)):
        tensors, at = {}, 0
        for key, dt, n in entry["parts"]:
            size = _part_bytes(dt, n)
            tensors[key] = payload[at: at + size].view(DTYPES[dt])
            at += _padded(size)
        d = Delta.from_wire(entry["header"], {f"b.{k}": t for k, t in tensors.items()}, "b")
        if d.base_crc != crcs[i]:
            raise DeltaMismatch(f"bucket {i}: the delta was built on another base (checksum differs)")
        deltas.append(d)
    return [apply_(_flat(buf, bucket.dtype), d, held_crc=crc)
            for bucket, buf, d, crc in zip(manifest.buckets, buffers, deltas, crcs)]
