"""A set of prompt indices kept as a bitmap, as Redis's ``prompts:dropped`` and the learner's checkpoints hold them.

Its own module because it is a plain data structure with no Redis in it: the queue builds one
from the bitmap it reads (rlpipe/queue.py dropped_indices), and the learner keeps the indices
its lineage trained in one (learner/ledger.py, learner/durability.py).
"""

from __future__ import annotations


class IndexSet:
    """A set of prompt indices as a bitmap (the cursor hands them out densely from 0), bit
    order as Redis's SETBIT (most significant bit first): the learner's lineage keeps the
    indices it trained, 1 bit each, in every checkpoint; Redis keeps those dropped."""

    def __init__(self, data: bytes = b""):
        self.bits = bytearray(data)

    def add(self, index: int) -> None:
        if index < 0:
            return
        byte = index >> 3
        if byte >= len(self.bits):
            self.bits.extend(bytes(byte + 1 - len(self.bits)))
        self.bits[byte] |= 0x80 >> (index & 7)

    def __contains__(self, index: int) -> bool:
        byte = index >> 3
        return 0 <= index and byte < len(self.bits) and bool(self.bits[byte] & (0x80 >> (index & 7)))

    def __len__(self) -> int:
        return sum(bin(b).count("1") for b in self.bits)

    def __iter__(self):
        return (i for i in range(len(self.bits) * 8) if i in self)

    def to_bytes(self) -> bytes:
        return bytes(self.bits)
