"""Weight deltas: a version's wire tensors as the bits that changed against the version a
worker already holds, each tensor in whichever encoding is smallest.

Between two consecutive int8 versions most int8 weights keep their value (an update far
below half a quantization step disappears in rounding, quant/monitor.py
``quant_update_visible_fraction``), so sending what changed can beat sending everything.
This module is the encoding alone; the sync protocol decides when to use it.

Encodings of one tensor (``n`` elements of ``w`` bytes, ``k`` of them changed):

- ``dense``: the whole new tensor, ``n * w`` bytes (what a full sync sends);
- ``sparse``: the gaps between changed positions, in the narrowest integer type that holds
  the largest gap (uint8, int16, int32 or int64), and the new values: ``k * (g + w)``;
- ``bitmap``: one bit per element (changed or not) and the new values: ``n / 8 + k * w``;
- ``sparse_unit``, ``bitmap_unit``: the same positions, and one sign bit per changed
  element in place of its value: the element moved one step of its integer view up or
  down (int8: one quantization step, what a small update mostly does; fp8/bf16/fp32: one
  ulp). The few that moved further are overwritten after, from a sparse list of their
  own (``xgaps``, ``xvalues``, left out when there are none): ``k * g + k / 8`` and
  ``n / 8 + k / 8``, plus ``e * (g' + w)`` for ``e`` such elements.

:func:`encode` picks the smallest by exact byte count. Elements are compared as integers
of their width (``_bits``), never as floats: -0.0 and 0.0 differ, a NaN equals itself bit
for bit, so :func:`apply` gives back exactly the new tensor's bits.

A :class:`Delta` carries two CRC-32s: of the base it was built on and of the tensor it
makes. The manifest will name the base version, but a worker that holds another base (a
missed version, a wrong generation, memory corruption) would otherwise apply the delta
and silently serve weights that are neither version. With the checksums :func:`apply_`
refuses a wrong base before writing, and detects a bad result after (then only a full
sync repairs the buffer). A worker keeps the checksum of what it holds from its last
apply, so each sync hashes only the tensors it produces.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

ENCODINGS = ("dense", "sparse", "bitmap", "sparse_unit", "bitmap_unit")
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GAP_TYPES = ((255, torch.uint8), (2**15 - 1, torch.int16), (2**31 - 1, torch.int32), (2**63 - 1, torch.int64))
_BIT = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


class DeltaMismatch(ValueError):
    """The delta was built on another base, or applying it did not give the tensor it describes."""


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (on the host: a CUDA tensor is copied)."""
    return zlib.crc32(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor as flat signed integers of its element width: exact comparison of any dtype."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool (n,) -> uint8 (ceil(n / 8),), element i in bit ``i % 8`` of byte ``i // 8``."""
    pad = (-mask.numel()) % 8
    m = torch.cat([mask.to(torch.uint8), mask.new_zeros(pad, dtype=torch.uint8)]).view(-1, 8)
    return (m * _BIT.to(m.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return ((packed[:, None] & _BIT.to(packed.device)) != 0).reshape(-1)[:n]


def _gap_type(largest: int) -> torch.dtype:
    return next(dt for limit, dt in _GAP_TYPES if largest <= limit)


@dataclass
class Delta:
    """One tensor's change: ``tensors`` are the plain tensors that travel (short keys:
    ``gaps``, ``mask``, ``values``, ``signs``, ``xgaps``, ``xvalues``; see :meth:`wire`),
    the rest is the small header the manifest carries (:meth:`header`)."""

    encoding: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]
    base_crc: int
    new_crc: int

    @property
    def nbytes(self) -> int:
        """Bytes of the wire tensors (the header adds a few dozen per tensor to the manifest)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    def wire(self, name: str) -> dict[str, torch.Tensor]:
        """``{"<name>.<key>": tensor}``: what the bucketed transport carries, flat and plain."""
        return {f"{name}.{k}": t for k, t in self.tensors.items()}

    def header(self) -> dict:
        return {"encoding": self.encoding, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "base_crc": self.base_crc, "new_crc": self.new_crc}

    @classmethod
    def from_wire(cls, header: dict, wire: dict[str, torch.Tensor], name: str) -> "Delta":
        """Rebuild a delta from its :meth:`header` and the wire tensors received under ``name``."""
        prefix = name + "."
        tensors = {k.removeprefix(prefix): t for k, t in wire.items() if k.startswith(prefix)}
        if set(tensors) - {"xgaps", "xvalues"} != set(_KEYS[header["encoding"]]) or \
                len(set(tensors) & {"xgaps", "xvalues"}) == 1:
            raise DeltaMismatch(f"{name}: {header['encoding']} needs {_KEYS[header['encoding']]}, got {sorted(tensors)}")
        return cls(header["encoding"], tuple(header["shape"]), getattr(torch, header["dtype"]), tensors,
                   header["base_crc"], header["new_crc"])


_KEYS = {"dense": ("values",), "sparse": ("gaps", "values"), "bitmap": ("mask", "values"),
         "sparse_unit": ("gaps", "signs"), "bitmap_unit": ("mask", "signs")}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def encode(base: torch.Tensor, new: torch.Tensor, base_crc: int | None = None) -> Delta:
    """The smallest delta that turns ``base`` into ``new`` (same shape and dtype).
    ``base_crc``: the base's checksum when the caller has it (the last version's
    ``new_crc``), saving one hash."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(f"base {base.dtype}{tuple(base.shape)} vs new {new.dtype}{tuple(new.shape)}")
    b, v = _bits(base), _bits(new)
    n, w = v.numel(), v.element_size()
    pos = (b != v).nonzero().reshape(-1)
    k = pos.numel()
    gaps = torch.diff(pos, prepend=pos.new_zeros(1)) if k else pos
    gap_dt = _gap_type(int(gaps.max()) if k else 0)
    g = torch.empty((), dtype=gap_dt).element_size()
    moved = v[pos].long() - b[pos].long() if w <= 4 else None
    far = (moved.abs() != 1).nonzero().reshape(-1) if w <= 4 else None  # in pos, the elements a sign cannot carry
    mask_bytes, sign_bytes = (n + 7) // 8, (k + 7) // 8
    sizes = {"dense": n * w, "sparse": k * (g + w), "bitmap": mask_bytes + k * w}
    if far is not None:
        xpos = pos[far]
        xgaps = torch.diff(xpos, prepend=xpos.new_zeros(1))
        x_dt = _gap_type(int(xgaps.max()) if xpos.numel() else 0)
        x_bytes = xpos.numel() * (torch.empty((), dtype=x_dt).element_size() + w)
        sizes |= {"sparse_unit": k * g + sign_bytes + x_bytes, "bitmap_unit": mask_bytes + sign_bytes + x_bytes}
    encoding = min(sizes, key=lambda e: (sizes[e], ENCODINGS.index(e)))
    tensors: dict[str, torch.Tensor] = {}
    if encoding == "dense":
        tensors["values"] = new.detach().reshape(-1)  # shares memory with new
    else:
        if encoding.startswith("sparse"):
            tensors["gaps"] = gaps.to(gap_dt)
        else:
            mask = torch.zeros(n, dtype=torch.bool, device=v.device)
            mask[pos] = True
            tensors["mask"] = pack_bits(mask)
        if encoding.endswith("unit"):
            tensors["signs"] = pack_bits(moved > 0)
            if xpos.numel():
                tensors["xgaps"], tensors["xvalues"] = xgaps.to(x_dt), new.detach().reshape(-1)[xpos]
        else:
            tensors["values"] = new.detach().reshape(-1)[pos]
    delta = Delta(encoding, tuple(new.shape), new.dtype, tensors,
                  checksum(base) if base_crc is None else base_crc, checksum(new))
    assert delta.nbytes == sizes[encoding], (encoding, delta.nbytes, sizes)
    return delta


def apply_(held: torch.Tensor, delta: Delta, held_crc: int | None = None, verify: bool = True) -> int:
    """In place: ``held`` (the base, as a worker keeps it in its engine) becomes the new
    tensor. With ``verify``, refuses a wrong base before writing anything (``held_crc``:
    its checksum when the caller kept it, else it is hashed) and checks the result after;
    raises :class:`DeltaMismatch`. Returns the new checksum, to keep for the next delta."""
    if tuple(held.shape) != delta.shape or held.dtype != delta.dtype:
        raise DeltaMismatch(f"held {held.dtype}{tuple(held.shape)}, delta for {delta.dtype}{delta.shape}")
    if verify and (checksum(held) if held_crc is None else held_crc) != delta.base_crc:
        raise DeltaMismatch("the delta was built on another base (checksum differs)")
    t = delta.tensors
    flat = held.view(-1) if held.is_contiguous() else None
    if flat is None:
        raise ValueError("apply_ needs a contiguous tensor")
    if delta.encoding == "dense":
        flat.copy_(t["values"].to(flat.device))
    else:
        if "gaps" in t:
            pos = t["gaps"].to(flat.device).long().cumsum(0)
        else:
            pos = unpack_bits(t["mask"].to(flat.device), flat.numel()).nonzero().reshape(-1)
        if "signs" in t:
            bits = _bits(flat)
            step = unpack_bits(t["signs"].to(flat.device), pos.numel()).to(bits.dtype) * 2 - 1
            bits[pos] += step  # (an element that moved further may wrap here: it is overwritten next)
            if "xgaps" in t:
                flat[t["xgaps"].to(flat.device).long().cumsum(0)] = t["xvalues"].to(flat.device)
        else:
            flat[pos] = t["values"].to(flat.device)
    if verify:
        crc = checksum(held)
        if crc != delta.new_crc:
            raise DeltaMismatch("applying the delta did not give the tensor it was built from (checksum differs)")
    return delta.new_crc


def apply(base: torch.Tensor, delta: Delta, verify: bool = True) -> torch.Tensor:
    """A new tensor: ``base`` with ``delta`` applied (``base`` is left as it is)."""
    out = base.detach().clone().contiguous()
    apply_(out, delta, verify=verify)
    return out


def encode_all(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, Delta]:
    """Every tensor of a version against the held one. The names must match: a tensor that
    appears or disappears changes the manifest, which takes a full sync."""
    if set(base) != set(new):
        raise ValueError(f"names differ: {sorted(set(base) ^ set(new))[:5]}")
    return {name: encode(base[name], t) for name, t in new.items()}


def totals(deltas: dict[str, Delta]) -> dict:
    """Bytes of the deltas against the full tensors, and how many tensors took each encoding."""
    full = sum(d.numel * torch.empty((), dtype=d.dtype).element_size() for d in deltas.values())
    sent = sum(d.nbytes for d in deltas.values())
    by = {e: sum(d.encoding == e for d in deltas.values()) for e in ENCODINGS}
    return {"delta_bytes": sent, "full_bytes": full, "ratio": sent / full if full else 0.0,
            "encodings": {e: c for e, c in by.items() if c}}
