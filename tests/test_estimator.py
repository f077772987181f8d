"""The regression Shapley estimator, the additivity test, and the estimator's figures from the shipped journal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from llmvisor.validation.analysis import rounded
from llmvisor.validation.estimator import complementary_coalitions, estimator_figures, prefix_coalitions, simulate_precision
from llmvisor.validation.game import additivity_test, exact_shapley, regression_shapley, subset_masks

REPO = Path(__file__).resolve().parents[1]


def additive_game(n: int, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    return 0.01, rng.uniform(0.001, 0.01, n)


def value(mask: int, b: float, f: np.ndarray) -> float:
    return b + sum(f[i] for i in range(f.size) if mask >> i & 1) if mask else 0.0


@pytest.mark.parametrize("n", [3, 6])
def test_noise_free_additive_game_gives_the_exact_shapley_value_from_any_full_rank_coalitions(n):
    rng = np.random.default_rng(n)
    b, f = additive_game(n, rng)
    full = (1 << n) - 1
    cost = np.array([value(int(m), b, f) for m in subset_masks(n)])
    exact = exact_shapley(cost)
    for _ in range(5):
        masks = [full] + [int(m) for m in rng.integers(1, full + 1, 3 * n)]  # any subsets, repeats allowed
        est = regression_shapley(masks, [cost[m] for m in masks], n)
        np.testing.assert_allclose(est["shapley_s"], exact, rtol=0, atol=1e-12)
        np.testing.assert_allclose(est["shapley_s"].sum(), cost[full], rtol=1e-12)
        weighted = regression_shapley(masks, [cost[m] for m in masks], n, weights=rng.uniform(0.5, 2.0, len(masks)))
        np.testing.assert_allclose(weighted["shapley_s"], exact, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("n", "m"), [(4, 9), (7, 15), (7, 127), (32, 65)])
def test_order_prefixes_are_the_permutation_designs_steps_and_the_regression_recovers_an_additive_game_on_them(n, m):
    """`prefix_coalitions`: the full batch first, then distinct proper subsets, at least m of them (every subset where m
    asks for all), each a prefix of an order whose reverse's prefixes are there too; an additive game's Shapley value
    comes back exactly from them."""
    rng = np.random.default_rng(n + m)
    masks = prefix_coalitions(n, m, rng)
    full = (1 << n) - 1
    assert masks[0] == full and len(set(masks)) == len(masks) >= m and all(0 < x <= full for x in masks)
    if m == full:
        assert sorted(masks) == list(range(1, full + 1))
    sizes = sorted(bin(x).count("1") for x in masks[1:])
    assert sizes.count(1) >= 2 and sizes.count(n - 1) >= 2  # each order pair starts with two singletons, ends with two (n-1)-sets
    b, f = additive_game(n, rng)
    np.testing.assert_allclose(regression_shapley(masks, [value(x, b, f) for x in masks], n)["shapley_s"], f + b / n, atol=1e-12)


def test_large_batches_and_the_control_variate_keep_the_exact_value():
    n = 64
    rng = np.random.default_rng(1)
    b, f = additive_game(n, rng)
    masks = complementary_coalitions(n, 2 * n + 11, rng)
    y = [value(m, b, f) for m in masks]
    np.testing.assert_allclose(regression_shapley(masks, y, n)["shapley_s"], f + b / n, atol=1e-12)

    class Control:  # a non-additive game (symmetric: its Shapley values split its full value equally)
        def __getitem__(self, mask):
            return 0.003 * bin(mask).count("1") ** 0.5

    # A measured game that is additive plus the control's non-additive cost: the plain fit misses the Shapley
    # value, the fit with the control variate finds it exactly.
    control, control_phi = Control(), np.full(n, Control()[(1 << n) - 1] / n)
    y = [value(m, b, f) + control[m] for m in masks]
    plain = regression_shapley(masks, y, n)["shapley_s"]
    est = regression_shapley(masks, y, n, control=control, control_shapley=control_phi)["shapley_s"]
    np.testing.assert_allclose(est, f + b / n + control_phi, atol=1e-12)
    assert np.max(np.abs(plain - (f + b / n + control_phi))) > 1e-4


def test_round_offsets_are_kept_out_of_the_values():
    """Orders measured in batch-rounds that drift: each round's steps shifted by its own offset. With the rounds as
    blocks the values are exact again; without, the offsets leak into them."""
    from llmvisor.validation.game import prefix_masks, sample_orders

    n = 12
    rng = np.random.default_rng(11)
    b, f = additive_game(n, rng)
    orders = sample_orders(n, 8, rng)
    first: dict[int, int] = {}
    for k, row in enumerate(prefix_masks(orders)):
        for m in row:
            first.setdefault(int(m), k)
    masks = sorted(first)
    offsets = rng.normal(0, 0.003, 8)
    offsets[first[(1 << n) - 1]] = 0.0  # the full batch's round is the reference
    y = [value(m, b, f) + offsets[first[m]] for m in masks]
    rounds = [first[m] for m in masks]
    blocked = regression_shapley(masks, y, n, blocks=rounds)
    np.testing.assert_allclose(blocked["shapley_s"], f + b / n, atol=1e-12)
    assert blocked["block_offsets_s"].size == len(set(rounds)) - 1
    assert np.max(np.abs(regression_shapley(masks, y, n)["shapley_s"] - (f + b / n))) > 1e-4


def test_the_fit_refuses_coalitions_it_cannot_use():
    with pytest.raises(ValueError, match="full batch"):
        regression_shapley([1, 2], [0.1, 0.2], 2)
    with pytest.raises(ValueError, match="tell the 3 players apart"):
        regression_shapley([7, 3, 7], [0.3, 0.2, 0.3], 3)  # players 0 and 1 always together


def test_intervals_cover_at_the_stated_level_on_a_noisy_additive_game():
    rng = np.random.default_rng(5)
    n, sigma, reps = 10, 0.001, 150
    covered = []
    for _ in range(reps):
        b, f = additive_game(n, rng)
        masks = complementary_coalitions(n, 41, rng)
        y = [value(m, b, f) + sigma * rng.standard_normal() for m in masks]
        est = regression_shapley(masks, y, n)
        covered.extend((est["ci_low_s"] <= f + b / n) & (f + b / n <= est["ci_high_s"]))
    # 1,500 estimates (10 per draw share its noise): 0.95 within ~4 binomial standard deviations
    assert abs(np.mean(covered) - 0.95) < 4 * math.sqrt(0.95 * 0.05 / reps)


def test_simulation_covers_and_pairs_beat_permutation_sampling_by_about_sqrt_n_over_2():
    result = simulate_precision(reps=6, seed=3)["by_size"]
    pooled = [(r["coverage_95"]["pair_regression"], r["n_estimates"]) for r in result.values()]
    n_total = sum(k for _, k in pooled)
    coverage = sum(c * k for c, k in pooled) / n_total
    assert abs(coverage - 0.95) < 0.05
    for n, r in result.items():
        ratio = r["precision_ratio_vs_permutation"]["pair_regression"] / math.sqrt(int(n) / 2)
        assert 0.55 < ratio < 1.4, (n, r)
    # Prefixes of orders are nested: the regression on them gains far less than on complementary pairs.
    for n in ("32", "64"):
        assert result[n]["precision_ratio_vs_permutation"]["prefix_regression"] < 0.6 * result[n]["precision_ratio_vs_permutation"]["pair_regression"]


def replicated(n, rng, interaction: float, repeats: int = 3, sigma: float = 0.0005):
    b, f = additive_game(n, rng)
    masks = [int(m) for m in subset_masks(n)[1:] for _ in range(repeats)]
    y = [value(m, b, f) + interaction * bin(m).count("1") ** 2 + sigma * rng.standard_normal() for m in masks]
    return masks, y


def test_additivity_test_rejects_a_planted_interaction_and_holds_its_level_on_an_additive_game():
    rng = np.random.default_rng(7)
    planted = additivity_test(*replicated(5, rng, interaction=0.0005), 5)
    assert planted["noise_source"] == "replicates" and planted["rejected"] and planted["p_value"] < 1e-6
    assert planted["interaction_rms"] > 0.0005
    rejected = [additivity_test(*replicated(5, rng, interaction=0.0), 5)["rejected"] for _ in range(200)]
    assert 0.01 < np.mean(rejected) < 0.10
    # Without repeats: against a given noise floor.
    masks, y = replicated(5, rng, interaction=0.0005, repeats=1)
    assert additivity_test(masks, y, 5, noise_var=0.0005**2, noise_dof=1000)["rejected"]
    masks, y = replicated(5, rng, interaction=0.0, repeats=1)
    external = additivity_test(masks, y, 5, noise_var=0.0005**2, noise_dof=1000)
    assert external["noise_source"] == "external" and external["interaction_rms"] < 0.0005


def test_figures_from_the_shipped_journal_match_the_committed_json():
    committed = json.loads((REPO / "docs" / "results" / "estimator.json").read_text(encoding="utf-8"))
    again = json.loads(json.dumps(rounded(estimator_figures(seed=committed["seed"]))))
    assert again == committed
    summary = again["summary"]
    assert set(summary["estimator"]["halfwidth_ratio_vs_permutation"]) == {"16", "32"}
    assert set(summary["sampled"]["halfwidth_over_share_p50"]) == {"sampled_decode", "sampled_prefill", "sampled_mixed", "sampled_shared_prefix_decode"}
    assert 0 < summary["estimator"]["exact_coverage_95"] <= 1


def test_kernel_shap_is_unbiased_on_a_non_additive_game_and_its_intervals_cover():
    from llmvisor.validation.game import kernel_shap, sample_kernel_pairs

    rng = np.random.default_rng(13)
    n = 6
    w = rng.uniform(0.5, 2.0, n)
    cost = np.array([0.0] + [0.01 + 0.002 * sum(w[i] for i in range(n) if m >> i & 1) ** 1.5 for m in range(1, 1 << n)])
    exact = exact_shapley(cost)
    estimates, covered = [], []
    for _ in range(300):
        masks = sample_kernel_pairs(n, 40, rng)
        est = kernel_shap(masks, cost[masks], n, full_cost_s=float(cost[-1]))
        np.testing.assert_allclose(est["shapley_s"].sum(), cost[-1], rtol=1e-12)
        estimates.append(est["shapley_s"])
        covered.extend((est["ci_low_s"] <= exact) & (exact <= est["ci_high_s"]))
    estimates = np.array(estimates)
    # unbiased: the mean of 300 estimates within 4 standard errors of the exact value, for every player
    assert np.all(np.abs(estimates.mean(axis=0) - exact) < 4 * estimates.std(axis=0) / math.sqrt(len(estimates)))
    assert abs(np.mean(covered) - 0.95) < 0.04
    with pytest.raises(ValueError, match="complement"):
        kernel_shap([1, 2, 3, 4], [0.1, 0.1, 0.1, 0.1], 3, full_cost_s=0.2)
