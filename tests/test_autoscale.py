"""The autoscaling rule (rlpipe/autoscale.py) on metrics rows, and the launch rules around it.
The fleet growing and shrinking with real processes is tests/test_autoscale_live.py."""

from __future__ import annotations

import pytest

from rlpipe.autoscale import FleetSizer, Window, decide
from rlpipe.config import AutoscaleConfig, ConfigError, build_config

CFG = AutoscaleConfig(min_workers=1, max_workers=6, scale_up_wait_fraction=0.25, scale_down_idle_fraction=0.3,
                      window_s=12.0, cooldown_s=10.0, converge_timeout_s=100.0)


def test_a_starved_learner_grows_the_fleet_in_proportion_to_its_wait():
    # 2 workers, never idle, the learner waits 75% of its time: 8 workers would feed it
    assert decide(CFG, Window(workers=2, wait_fraction=0.75, idle_fraction=0.0)) == 6  # capped at max_workers
    assert decide(CFG, Window(workers=2, wait_fraction=0.5, idle_fraction=0.0)) == 4
    # just past the threshold: at least one more
    assert decide(CFG, Window(workers=2, wait_fraction=0.26, idle_fraction=0.0)) == 3


def test_idle_workers_shrink_the_fleet_one_at_a_time_down_to_the_bound():
    assert decide(CFG, Window(workers=4, wait_fraction=0.0, idle_fraction=0.9)) == 3
    assert decide(CFG, Window(workers=1, wait_fraction=0.0, idle_fraction=0.9)) == 1


def test_no_shrink_that_the_next_window_would_undo():
    """2 workers idling 45% do 1.1 workers' work: one alone would starve the learner, and the
    rule would grow again (measured on the toy: 2 -> 1 -> 2 every minute before this rule)."""
    assert decide(CFG, Window(workers=2, wait_fraction=0.06, idle_fraction=0.45)) == 2
    # 3 workers idling 60% do 1.2 workers' work: 2 would idle 40%, above the 30% kept
    assert decide(CFG, Window(workers=3, wait_fraction=0.0, idle_fraction=0.6)) == 2
    assert decide(CFG, Window(workers=3, wait_fraction=0.0, idle_fraction=0.5)) == 3  # 2 would idle 25%


def test_between_the_thresholds_or_with_both_high_the_fleet_holds():
    assert decide(CFG, Window(workers=3, wait_fraction=0.2, idle_fraction=0.2)) == 3  # balanced enough
    # both high: something else limits the run (max_lag, syncs); more or fewer workers would not help
    assert decide(CFG, Window(workers=3, wait_fraction=0.6, idle_fraction=0.6)) == 3


def rows(n: int, workers: int, wait: float, step: float, idle_per_s: float, start: float = 0.0, idle0: float = 0.0):
    """``n`` metrics rows one step apart: each step waits ``wait`` s and trains ``step`` s; the
    fleet idles ``idle_per_s`` worker-seconds per second."""
    out, t, idle = [], start, idle0
    for _ in range(n):
        t += wait + step
        idle += idle_per_s * (wait + step)
        out.append({"rollout_workers": workers, "learner_wait_seconds": wait, "learner_step_seconds": step,
                    "time": t, "rollout_idle_seconds_total": idle})
    return out


def test_the_sizer_decides_on_a_full_window_at_one_size_and_waits_for_the_fleet_it_asked_for():
    sizer = FleetSizer(CFG)
    starving = rows(8, workers=1, wait=3.0, step=1.0, idle_per_s=0.0)  # 4 s a step
    outs = [sizer.observe(r) for r in starving[:3]]
    assert [o["fleet_desired_workers"] for o in outs] == [1, 1, 1]  # 8 s measured: the 12 s window is not full
    assert "fleet_wait_fraction" not in outs[-1]
    out = sizer.observe(starving[3])
    assert out["fleet_wait_fraction"] == pytest.approx(0.75) and out["fleet_idle_fraction"] == 0.0
    assert out["fleet_desired_workers"] == 4  # 1 worker / (1 - 0.75)
    # The new workers are starting (engine loads): the fleet is still 1, and however long that
    # takes within converge_timeout_s, the rule does not judge the fleet it is leaving.
    late = rows(20, workers=1, wait=0.0, step=2.0, idle_per_s=1.0, start=starving[3]["time"])
    assert {sizer.observe(r)["fleet_desired_workers"] for r in late} == {4}  # 40 s of idling: held
    # The fleet grew: a window at 4 workers is measured before anything else is decided.
    grown = rows(7, workers=4, wait=0.0, step=2.0, idle_per_s=4 * 0.8, start=late[-1]["time"])
    assert [sizer.observe(r)["fleet_desired_workers"] for r in grown[:6]] == [4] * 6
    out = sizer.observe(grown[6])
    assert out["fleet_idle_fraction"] == pytest.approx(0.8) and out["fleet_desired_workers"] == 3


def test_a_fleet_that_never_reaches_its_size_is_judged_after_the_converge_timeout():
    sizer = FleetSizer(CFG)
    for r in rows(4, workers=1, wait=3.0, step=1.0, idle_per_s=0.0):
        sizer.observe(r)
    assert sizer.desired == 4
    # no new worker ever registers (no GPU left), and the learner turns slow: after 100 s the
    # rule judges the single worker, now idle, and asks for the bound
    out = [sizer.observe(r) for r in rows(30, workers=1, wait=0.0, step=4.0, idle_per_s=0.9, start=16.0)]
    assert out[-1]["fleet_desired_workers"] == 1


def test_a_worker_leaving_mid_window_restarts_the_window():
    """The fleet's idle seconds sum the registered workers: one leaving takes its seconds
    out of the total, so a window across a size change would read nonsense."""
    sizer = FleetSizer(CFG)
    for r in rows(4, workers=3, wait=0.0, step=4.0, idle_per_s=3.0):
        sizer.observe(r)
    out = sizer.observe(rows(1, workers=2, wait=0.0, step=4.0, idle_per_s=0.0, start=16.0, idle0=1.0)[0])
    assert "fleet_idle_fraction" not in out and out["fleet_desired_workers"] == 2


def test_autoscale_bounds_are_checked_at_launch():
    with pytest.raises(ConfigError, match="autoscale.min_workers: 3 is above max_workers 2"):
        build_config({"autoscale": {"min_workers": 3, "max_workers": 2}}, environ={})
    with pytest.raises(ConfigError, match="workers: 5 is outside autoscale.min_workers..max_workers"):
        build_config({"workers": 5, "autoscale": {"enabled": True, "max_workers": 3}}, environ={})
    cfg = build_config({"workers": 1, "autoscale": {"enabled": True, "max_workers": 3}}, environ={})
    assert cfg.worker_slots == 3  # CPU and GPU slices are planned for the most workers the run may have
    assert build_config({"workers": 2}, environ={}).worker_slots == 2


def test_rlpipe_up_autoscale_sets_the_bounds_and_starts_at_the_minimum():
    from launch.cli import _overrides, _parser

    args = _parser().parse_args(["up", "--autoscale", "2:5"])
    assert _overrides(args) == {"autoscale.enabled": True, "autoscale.min_workers": 2, "autoscale.max_workers": 5,
                                "workers": 2}
    with pytest.raises(ConfigError, match="--autoscale '5': expected MIN:MAX"):
        _overrides(_parser().parse_args(["up", "--autoscale", "5"]))
