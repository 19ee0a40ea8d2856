"""LR schedules against values worked out by hand (learner/schedule.py)."""

from __future__ import annotations

import json
import logging
import math
import random

import pytest
import torch

from learner.schedule import LRSchedule, apply_lr
from rlpipe.config import ScheduleConfig


def surge_trace(t: int) -> float:
    """Flat at 10, jumping to 30 at step 20."""
    return 30.0 if t >= 20 else 10.0


def lrs(sched: LRSchedule, trace, steps: int, start: int = 1) -> dict[int, float]:
    """{step: LR used for that step} for steps start+1 .. steps+1, feeding trace(t) after step t."""
    return {t + 1: sched.update(t, trace(t)) for t in range(start, steps + 1)}


def changes(seq: dict[int, float]) -> list[tuple[int, float]]:
    """(first step, LR) for each distinct LR in order."""
    out: list[tuple[int, float]] = []
    for step, lr in seq.items():
        if not out or not math.isclose(lr, out[-1][1]):
            out.append((step, lr))
    return out


def test_constant_with_warmup():
    s = LRSchedule(ScheduleConfig(kind="constant", warmup_steps=4), base_lr=1.0, total_steps=100)
    assert s.next_lr() == pytest.approx(0.25)
    assert [s.update(t, 10.0) for t in range(1, 6)] == pytest.approx([0.5, 0.75, 1.0, 1.0, 1.0])
    assert LRSchedule(ScheduleConfig(warmup_steps=0), base_lr=3e-4, total_steps=10).next_lr() == 3e-4
    # warmup is on by default (docs/lr_warmup): the first step takes a fifth of the LR
    assert LRSchedule(ScheduleConfig(), base_lr=3e-4, total_steps=10).next_lr() == pytest.approx(6e-5)


def test_warmup_cosine_endpoints_and_midpoint():
    cfg = ScheduleConfig(kind="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1)
    s = LRSchedule(cfg, base_lr=1.0, total_steps=110)
    seq = {1: s.next_lr(), **lrs(s, lambda t: 0.0, 199)}
    assert seq[1] == pytest.approx(0.1)
    assert seq[5] == pytest.approx(0.5)
    assert seq[10] == pytest.approx(1.0)
    assert seq[35] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))  # a quarter: 0.868198
    assert seq[60] == pytest.approx(0.55)  # halfway between 1.0 and 0.1
    assert seq[110] == pytest.approx(0.1)
    assert seq[200] == pytest.approx(0.1)  # clamped after the last step
    assert all(a >= b for a, b in zip([seq[t] for t in range(10, 200)], [seq[t] for t in range(11, 201)]))


def test_length_surge_detects_and_halves_on_period():
    # smooth=3: L_19=10, L_20=(10+10+30)/3=16.7 < 20, L_21=(10+30+30)/3=23.3 >= 2*10 -> s=21.
    # decay_period = round(1.8*21) = 38: halvings after steps 38, 76, 114, 152 (the last one floored at 0.1).
    cfg = ScheduleConfig(kind="length_surge", surge_factor=2.0, surge_smooth=3, surge_window=10, min_lr_ratio=0.1, warmup_steps=0)
    s = LRSchedule(cfg, base_lr=1.0, total_steps=400)
    assert s.next_lr() == 1.0
    seq = lrs(s, surge_trace, 20)
    assert s.state()["surge_step"] is None and s.state()["decay_period"] is None
    seq.update(lrs(s, surge_trace, 400, start=21))
    assert s.state()["surge_step"] == 21 and s.state()["decay_period"] == 38
    assert changes(seq) == [(2, 1.0), (39, 0.5), (77, 0.25), (115, 0.125), (153, 0.1)]
    assert min(seq.values()) == pytest.approx(0.1)
    st = s.state()
    assert st == {"kind": "length_surge", "lr": pytest.approx(0.1), "surge_step": 21, "decay_period": 38,
                  "halvings": 4}
    json.dumps(st)


def test_length_surge_explicit_period_and_warmup():
    cfg = ScheduleConfig(kind="length_surge", decay_period=25, warmup_steps=50, min_lr_ratio=0.1)
    s = LRSchedule(cfg, base_lr=1.0, total_steps=400)
    seq = lrs(s, surge_trace, 200)
    assert s.state()["surge_step"] == 21 and s.state()["decay_period"] == 25
    assert seq[25] == pytest.approx(25 / 50)  # warmup only
    assert seq[26] == pytest.approx(0.5 * 26 / 50)  # halved after step 25, warmup on top
    assert seq[50] == pytest.approx(0.5 * 50 / 50)
    assert changes({t: v for t, v in seq.items() if t > 50}) == [(51, 0.25), (76, 0.125), (101, 0.1)]


def test_length_surge_surge_window_and_no_false_triggers():
    cfg = ScheduleConfig(kind="length_surge", surge_factor=2.0, surge_smooth=3, surge_window=10, warmup_steps=0)
    # A flat, noisy trace: 10 +- 2 can never double.
    rng = random.Random(0)
    s = LRSchedule(cfg, base_lr=1.0, total_steps=1000)
    assert set(lrs(s, lambda t: 10 + rng.uniform(-2, 2), 1000).values()) == {1.0}
    assert s.state()["surge_step"] is None and s.state()["halvings"] == 0
    # One 3x spike is smoothed away: (10+10+30)/3 < 20.
    s = LRSchedule(cfg, base_lr=1.0, total_steps=100)
    lrs(s, lambda t: 30.0 if t == 40 else 10.0, 100)
    assert s.state()["surge_step"] is None
    # A slow ramp 10+t/2 (L_t = 10+(t-1)/2) doubles only over more steps than the window holds...
    s = LRSchedule(cfg, base_lr=1.0, total_steps=100)
    lrs(s, lambda t: 10 + t / 2, 100)
    assert s.state()["surge_step"] is None
    # ...but with a long window it triggers once L_t >= 2*L_3 = 22, i.e. at t=25.
    s = LRSchedule(cfg.model_copy(update={"surge_window": 100}), base_lr=1.0, total_steps=100)
    lrs(s, lambda t: 10 + t / 2, 100)
    assert s.state()["surge_step"] == 25


def test_length_surge_not_redetected_and_logs(caplog):
    cfg = ScheduleConfig(kind="length_surge", decay_period=10, min_lr_ratio=0.0, warmup_steps=0)
    s = LRSchedule(cfg, base_lr=1.0, total_steps=400)
    with caplog.at_level(logging.INFO, logger="learner.schedule"):
        lrs(s, lambda t: 10.0 * 3 ** (t // 20), 45)  # surges again at 40
    assert s.state()["surge_step"] == 21
    assert s.state()["halvings"] == 2  # after steps 30 and 40
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("surge" in m for m in msgs) == 1
    assert sum("halved" in m for m in msgs) == 2


@pytest.mark.parametrize("kind", ["constant", "warmup_cosine", "length_surge"])
@pytest.mark.parametrize("k", [5, 19, 21, 38, 39, 100])
def test_state_dict_round_trip(kind, k):
    cfg = ScheduleConfig(kind=kind, warmup_steps=8)
    full = LRSchedule(cfg, base_lr=1e-3, total_steps=300)
    expected = lrs(full, surge_trace, 300)

    first = LRSchedule(cfg, base_lr=1e-3, total_steps=300)
    before = lrs(first, surge_trace, k)
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = LRSchedule(cfg, base_lr=1e-3, total_steps=300)
    resumed.load_state_dict(saved)
    assert resumed.state() == first.state()
    after = lrs(resumed, surge_trace, 300, start=k + 1)
    assert {**before, **after} == expected
    assert resumed.state() == full.state()
    if kind == "length_surge":
        assert full.state()["surge_step"] == 21 and full.state()["halvings"] == 4


def test_apply_lr_sets_every_param_group():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5.0}], lr=1e-3)
    apply_lr(opt, 0.123)
    assert [g["lr"] for g in opt.param_groups] == [0.123, 0.123]
    (a.sum() + b.sum()).backward()
    opt.step()
    assert torch.allclose(a.detach(), torch.full((2,), -0.123), atol=1e-4)  # Adam's first step moves by ~lr


@pytest.mark.parametrize("dip, surge", [(10, 20), (9, None)])
def test_surge_window_is_the_previous_window_steps(dip, surge):
    # smooth=1, window=10: step 20's 20.0 is compared with the minimum of steps 10..19.
    cfg = ScheduleConfig(kind="length_surge", surge_factor=2.0, surge_smooth=1, surge_window=10, warmup_steps=0)
    s = LRSchedule(cfg, base_lr=1.0, total_steps=100)
    lrs(s, lambda t: 10.0 if t == dip else 20.0 if t == 20 else 15.0, 60)
    assert s.state()["surge_step"] == surge
