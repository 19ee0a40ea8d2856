"""weight_sync/delta_codec.py: deltas give back the new tensor bit for bit, in the smallest encoding,
and refuse a base they were not built on. CPU, no engines."""

import math

import numpy as np
import pytest
import torch

from weight_sync.delta_codec import Delta, DeltaMismatch, apply, apply_, encode, encode_all, totals


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and \
        a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()


def changed_int8(base: torch.Tensor, k: int, seed: int = 0, unit_share: float = 0.9) -> torch.Tensor:
    """``base`` with ``k`` elements changed, most by one step (as a small update does)."""
    g = torch.Generator().manual_seed(seed)
    new = base.clone().reshape(-1)
    pos = torch.randperm(new.numel(), generator=g)[:k]
    unit = torch.rand(k, generator=g) < unit_share
    step = torch.where(unit, torch.randint(0, 2, (k,), generator=g) * 2 - 1, torch.randint(2, 60, (k,), generator=g))
    moved = (new[pos].long() + step).clamp(-128, 127)
    moved = torch.where(moved == new[pos].long(), new[pos].long() - step, moved)  # at the clamp: the other way
    new[pos] = moved.to(torch.int8)
    return new.reshape(base.shape)


def expected_sizes(base: torch.Tensor, new: torch.Tensor) -> dict[str, int]:
    """Every encoding's byte count, computed here with numpy from the definitions."""
    w = new.element_size()
    b = base.reshape(-1).view(torch.uint8).numpy().view(f"i{w}").astype(np.int64)
    v = new.reshape(-1).view(torch.uint8).numpy().view(f"i{w}").astype(np.int64)
    n = v.size
    pos = np.flatnonzero(b != v)
    k = pos.size

    def gap_bytes(p):
        if not p.size:
            return 1
        largest = int(np.diff(p, prepend=0).max())
        return 1 if largest <= 255 else 2 if largest < 2**15 else 4 if largest < 2**31 else 8

    far = pos[np.abs(v[pos] - b[pos]) != 1]
    extra = far.size * (gap_bytes(far) + w)
    return {"dense": n * w, "sparse": k * (gap_bytes(pos) + w), "bitmap": math.ceil(n / 8) + k * w,
            "sparse_unit": k * gap_bytes(pos) + math.ceil(k / 8) + extra,
            "bitmap_unit": math.ceil(n / 8) + math.ceil(k / 8) + extra}


def check(base: torch.Tensor, new: torch.Tensor) -> Delta:
    d = encode(base, new)
    assert same_bits(apply(base, d), new)
    sizes = expected_sizes(base, new)
    assert d.nbytes == sizes[d.encoding] == min(sizes.values()), (d.encoding, sizes)
    return d


@pytest.mark.parametrize("k", [0, 1, 655, 19660, 65536])  # none, one, 1%, 30%, all
def test_int8_round_trip_at_every_change_fraction(k):
    base = torch.randint(-128, 128, (256, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    d = check(base, changed_int8(base, k))
    if k == 0:
        assert d.nbytes == 0
    if k == 19660:  # 30% moved, 90% of them by one step: a mask and signs beat the values
        assert d.encoding == "bitmap_unit"


def test_int8_every_element_changed_by_more_than_one_step_is_dense():
    base = torch.zeros(1000, dtype=torch.int8)
    assert check(base, torch.full((1000,), 5, dtype=torch.int8)).encoding == "dense"


def test_int8_wrapping_extremes():
    base = torch.tensor([127, -128, 0, 127, -128, -1], dtype=torch.int8)
    new = torch.tensor([-128, 127, -1, 126, -127, 0], dtype=torch.int8)
    check(base, new)


def test_fp32_scales_signed_zeros_and_nan_payloads():
    base = torch.tensor([0.0, -0.0, 1.0, float("nan"), 3.0, 2.5] * 20, dtype=torch.float32)
    new = base.clone()
    new[0], new[1] = -0.0, 0.0  # equal as floats, different bits
    nan_bits = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    new[3] = nan_bits[0]  # another NaN payload
    new[4] = torch.nextafter(torch.tensor(3.0), torch.tensor(4.0))  # one ulp
    d = check(base, new)
    assert d.encoding != "dense" or d.nbytes == 480
    assert same_bits(apply(base, d)[:4], new[:4])
    assert check(new, new).nbytes == 0  # NaN equals itself bit for bit: nothing to send


def test_bf16_and_fp8():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g)
    check(w.bfloat16(), (w + 0.01 * torch.randn(64, 96, generator=g)).bfloat16())
    check(w.bfloat16(), (w * (1 + 1e-3)).bfloat16())
    f8 = (w * 50).to(torch.float8_e4m3fn)
    check(f8, (w * 50 * 1.02).to(torch.float8_e4m3fn))
    check(f8, (w * 50 + torch.randn(64, 96, generator=g)).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("shape", [(0,), (0, 8), ()])
def test_empty_and_scalar(shape):
    base = torch.zeros(shape, dtype=torch.float32)
    check(base, base.clone())
    check(base, torch.full(shape, 2.0))


def test_large_gaps_need_wider_positions():
    base = torch.zeros(200_000, dtype=torch.int8)
    new = base.clone()
    new[[5, 70_000, 199_999]] = torch.tensor([9, 9, 9], dtype=torch.int8)
    d = check(base, new)
    assert d.encoding == "sparse" and d.tensors["gaps"].dtype == torch.int32


def test_apply_in_place_into_the_held_buffer():
    base = torch.randint(-128, 128, (128, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    new = changed_int8(base, 800)
    d = encode(base, new)
    held = base.clone()
    ptr = held.data_ptr()
    crc = apply_(held, d)
    assert held.data_ptr() == ptr and same_bits(held, new)
    # the next version: the checksum kept from this apply stands for the held tensor
    newer = changed_int8(new, 50, seed=4)
    apply_(held, encode(new, newer, base_crc=crc), held_crc=crc)
    assert same_bits(held, newer)


def test_a_delta_on_another_base_is_refused_before_writing():
    base = torch.randint(-128, 128, (4096,), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    d = encode(base, changed_int8(base, 40))
    other = changed_int8(base, 1, seed=6)  # one element off: a missed version, a flipped bit
    before = other.clone()
    with pytest.raises(DeltaMismatch, match="another base"):
        apply_(other, d)
    assert same_bits(other, before)
    with pytest.raises(DeltaMismatch, match="another base"):
        apply_(base.clone(), d, held_crc=d.base_crc ^ 1)


def test_corrupted_wire_is_caught_after_applying():
    base = torch.randint(-128, 128, (4096,), dtype=torch.int8, generator=torch.Generator().manual_seed(7))
    d = encode(base, changed_int8(base, 400, unit_share=0.5))
    d.tensors["values" if "values" in d.tensors else "xvalues"][0] += 1
    with pytest.raises(DeltaMismatch, match="did not give"):
        apply(base, d)


def test_rebuilt_from_wire_tensors_and_header():
    g = torch.Generator().manual_seed(8)
    base = {"a.weight": torch.randint(-128, 128, (64, 64), dtype=torch.int8, generator=g),
            "a.weight_scale": torch.rand(64, 1, generator=g), "norm.weight": torch.randn(64, generator=g).bfloat16()}
    new = {"a.weight": changed_int8(base["a.weight"], 500, unit_share=0.8), "a.weight_scale": base["a.weight_scale"] * 1.01,
           "norm.weight": base["norm.weight"]}
    deltas = encode_all(base, new)
    wire = {k: t for name, d in deltas.items() for k, t in d.wire(name).items()}
    assert all(t.dim() == 1 for t in wire.values())
    for name, d in deltas.items():
        back = Delta.from_wire(d.header(), wire, name)
        assert same_bits(apply(base[name], back), new[name])
    t = totals(deltas)
    assert t["delta_bytes"] == sum(d.nbytes for d in deltas.values()) < t["full_bytes"] == 64 * 64 + 64 * 4 + 64 * 2
    with pytest.raises(DeltaMismatch):
        Delta.from_wire({**deltas["a.weight"].header(), "encoding": "sparse"}, wire, "a.weight")
    with pytest.raises(ValueError, match="names differ"):
        encode_all(base, {**new, "b.weight": new["a.weight"]})
