"""The one quantile summary and the one bootstrap (`llmvisor.core.stats`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmvisor.core.stats import bootstrap_interval, bootstrap_quantile_ci, percentile_interval, quantile_summary, resample_counts


def test_quantile_summary_is_numpys_percentiles_with_the_requested_extras():
    values = np.random.default_rng(0).lognormal(size=101)
    out = quantile_summary(values, (10, 50, 99), mean=True, maximum=True)
    assert list(out) == ["n", "mean", "p10", "p50", "p99", "max"]
    assert out["n"] == 101 and out["mean"] == values.mean() and out["max"] == values.max()
    assert [out["p10"], out["p50"], out["p99"]] == np.percentile(values, [10, 50, 99]).tolist()
    assert [out["p10"], out["p50"], out["p99"]] == np.quantile(values, [0.1, 0.5, 0.99]).tolist()  # the same numbers either way
    named = quantile_summary(iter(values.tolist()), (0, 100), names=("min", "max"))
    assert named == {"n": 101, "min": values.min(), "max": values.max()}


def test_quantile_summary_of_nothing_says_so():
    assert quantile_summary([], (50, 99)) == {"n": 0, "p50": None, "p99": None}
    nan = quantile_summary([], (50,), maximum=True, empty=float("nan"))
    assert nan["n"] == 0 and math.isnan(nan["p50"]) and math.isnan(nan["max"])
    assert quantile_summary([], (50,), mean=True, empty="omit") == {"n": 0}


@pytest.mark.parametrize("draw", ["counts", "indices"])
def test_resamples_draw_every_unit_count_times_in_total_and_repeat_for_a_seed(draw):
    first = np.concatenate(list(resample_counts(13, 250, 4, draw=draw)))
    again = np.concatenate(list(resample_counts(13, 250, 4, draw=draw, chunk=7)))  # chunking does not change the draws
    assert first.shape == (250, 13) and (first.sum(axis=1) == 13).all()
    np.testing.assert_array_equal(first, again)
    assert abs(first.mean() - 1.0) < 0.05  # each unit drawn once per resample on average


def test_interval_leaves_out_resamples_that_define_nothing():
    resampled = np.array([[1.0, np.nan], [2.0, np.nan], [3.0, np.nan]])
    low, high = percentile_interval(resampled, 0.5)
    assert (low[0], high[0]) == (1.5, 2.5) and math.isnan(low[1]) and math.isnan(high[1])
    low, high = bootstrap_interval(lambda counts: counts[:, :1], 5, n_resamples=400)
    assert 0 <= low[0] < 1 < high[0] <= 5


def test_group_bootstrap_resamples_whole_groups():
    """Values alike within a group: resampling groups gives a wider interval than resampling values one by one."""
    rng = np.random.default_rng(1)
    values = np.repeat(rng.normal(size=40), 5) + rng.normal(scale=0.01, size=200)
    grouped = bootstrap_quantile_ci(values, (50,), groups=np.repeat(np.arange(40), 5), resample="groups", n_resamples=400)
    single = bootstrap_quantile_ci(values, (50,), groups=np.arange(200), resample="groups", n_resamples=400)
    width = {name: np.diff(out["ci"][50])[0] for name, out in (("grouped", grouped), ("single", single))}
    assert grouped["n_blocks"] == 40 and width["grouped"] > 1.5 * width["single"]
    with pytest.raises(ValueError, match="unknown resample"):
        bootstrap_quantile_ci(values, (50,), resample="steps")
