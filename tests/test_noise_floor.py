"""The one noise floor (`llmvisor.core.stats.replicate_noise_floor`): it estimates one measurement's error whatever
the number of repeats, which a pair's half-difference (|t - median| / median of two) does not."""

import numpy as np
import pytest

from llmvisor.core.stats import replicate_noise_floor

HALF_NORMAL_P50 = 0.6744897501960817  # median of |N(0, 1)|


@pytest.mark.parametrize("k", [2, 3, 8])
def test_the_floor_estimates_one_measurements_error_for_any_number_of_repeats(k):
    rng = np.random.default_rng(k)
    sigma = 0.03
    groups = [5.0 * (1 + sigma * rng.standard_normal(k)) for _ in range(3000 // k)]
    floor = replicate_noise_floor(groups, n_resamples=200)
    assert floor["p50"] == pytest.approx(sigma * HALF_NORMAL_P50, rel=0.08)
    low, high = floor["interval"]["p50"]
    assert low < floor["p50"] < high
    assert floor["n_groups"] == 3000 // k and floor["n_measurements"] == k * (3000 // k)


def test_a_pairs_half_difference_would_understate_it_by_sqrt2():
    rng = np.random.default_rng(0)
    pairs = [1 + 0.02 * rng.standard_normal(2) for _ in range(2000)]
    half_difference = np.median([abs(a - b) / 2 / np.mean([a, b]) for a, b in pairs])
    assert replicate_noise_floor(pairs, n_resamples=100)["p50"] / half_difference == pytest.approx(np.sqrt(2), rel=0.02)


def test_scales_replace_the_group_mean_and_single_measurements_are_left_out():
    floor = replicate_noise_floor([[1.0, 1.2], [7.0]], scales=[10.0, 1.0], n_resamples=50)
    assert floor["n_groups"] == 1 and floor["p50"] == pytest.approx(0.1 * np.sqrt(2) / 10)
    assert replicate_noise_floor([[3.0], []]) is None


def test_clusters_resample_groups_together():
    """Requests of one batch share its measurements: with ``clusters`` the bootstrap draws whole batches, so the
    interval is wider than one that treats correlated groups as independent."""
    rng = np.random.default_rng(1)
    groups, clusters = [], []
    for batch in range(40):
        shift = 0.05 * rng.standard_normal()  # a batch-wide disturbance shared by its 8 requests
        for _ in range(8):
            groups.append([1.0, 1.0 + shift + 0.005 * rng.standard_normal()])
            clusters.append(batch)
    independent = replicate_noise_floor(groups, n_resamples=300)
    clustered = replicate_noise_floor(groups, clusters=clusters, n_resamples=300)
    assert clustered["p50"] == independent["p50"]
    width = {name: f["interval"]["p50"][1] - f["interval"]["p50"][0] for name, f in (("i", independent), ("c", clustered))}
    assert width["c"] > 1.5 * width["i"]
