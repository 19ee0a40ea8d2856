"""bench/staleness_cost.py: the workers' idle fraction over a whole run, from the running total
of their idle seconds in the learner's metrics rows."""

from __future__ import annotations

import pytest

from bench.staleness_cost import idle_fraction


def test_idle_fraction_is_the_idle_seconds_gained_over_workers_times_the_span():
    rows = [{"time": 10.0, "rollout_idle_seconds_total": 4.0, "rollout_workers": 2},
            {"time": 20.0, "rollout_idle_seconds_total": 9.0, "rollout_workers": 2},
            {"time": 30.0, "rollout_idle_seconds_total": 12.0, "rollout_workers": 2}]
    assert idle_fraction(rows) == pytest.approx((12.0 - 4.0) / (2 * 20.0))  # not counting idle before the first row


def test_idle_fraction_needs_two_rows_with_workers():
    assert idle_fraction([{"time": 1.0, "rollout_idle_seconds_total": 3.0, "rollout_workers": 2}]) is None
    assert idle_fraction([{"time": 1.0, "rollout_idle_seconds_total": 0.0, "rollout_workers": 0},
                          {"time": 2.0, "rollout_idle_seconds_total": 1.0, "rollout_workers": 0}]) is None
