"""Shapley values from sampled orders: agreement with exact enumeration at the stated coverage, antithetic gain."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from llmvisor.validation.game import (
    exact_shapley,
    members,
    order_marginals,
    prefix_masks,
    sample_orders,
    sampled_shapley,
    subsets_to_measure,
)


def synthetic_game(n: int, rng: np.random.Generator, *, interaction: float = 1.0, noise: float = 0.02) -> np.ndarray:
    """A step-cost game like the measured ones: shared intercept + own terms + interactions + measurement noise.

    Interactions: a cost on the longest member (padding) and a saving per pair of members (the decode
    subadditivity measured on the CPU engine). The noise is drawn once per subset, as a measurement would be.
    """
    own = rng.uniform(0.001, 0.02, n)
    intercept = rng.uniform(0.005, 0.02)
    lengths = rng.uniform(1, 10, n)
    cost = np.zeros(1 << n)
    for mask in range(1, 1 << n):
        m = members(mask, n)
        pairs = len(m) * (len(m) - 1) / 2
        cost[mask] = intercept + own[m].sum() + interaction * (0.001 * lengths[m].max() - 0.0001 * pairs)
    cost[1:] *= 1 + noise * rng.standard_normal((1 << n) - 1)
    return cost


def test_every_order_once_gives_the_exact_value():
    rng = np.random.default_rng(3)
    cost = synthetic_game(4, rng)
    orders = np.array(list(itertools.permutations(range(4))))
    result = sampled_shapley(orders, cost, antithetic=False)
    np.testing.assert_allclose(result["shapley_s"], exact_shapley(cost), rtol=0, atol=1e-15)


def test_each_order_splits_the_whole_step_and_visits_only_its_prefixes():
    rng = np.random.default_rng(4)
    cost = synthetic_game(6, rng)
    orders = sample_orders(6, 10, rng)
    np.testing.assert_allclose(order_marginals(orders, cost).sum(axis=1), cost[-1], rtol=1e-12)
    assert sampled_shapley(orders, cost)["shapley_s"].sum() == pytest.approx(cost[-1], rel=1e-12)
    np.testing.assert_array_equal(orders[1::2], orders[0::2, ::-1])
    needed = subsets_to_measure(orders)
    assert needed[-1] == (1 << 6) - 1 and len(needed) <= 10 * 5 + 1
    # only the measured subsets are read: a mapping holding just those is enough
    measured = {m: cost[m] for m in needed}
    np.testing.assert_allclose(sampled_shapley(orders, measured)["shapley_s"], sampled_shapley(orders, cost)["shapley_s"])
    assert all(bin(int(m)).count("1") == j + 1 for row in prefix_masks(orders) for j, m in enumerate(row))


@pytest.mark.parametrize("antithetic", [True, False])
def test_sampled_intervals_cover_the_exact_value_at_about_the_stated_rate(antithetic):
    """Over 400 random games of 4–6 players, 16 orders each, the 95% intervals hold the exact value ~95% of the time."""
    rng = np.random.default_rng(11)
    hits = total = 0
    for _ in range(400):
        n = int(rng.integers(4, 7))
        cost = synthetic_game(n, rng)
        exact = exact_shapley(cost)
        result = sampled_shapley(sample_orders(n, 16, rng, antithetic=antithetic), cost, antithetic=antithetic)
        tol = 1e-12 * cost[-1]
        hits += int(np.sum((result["ci_low_s"] - tol <= exact) & (exact <= result["ci_high_s"] + tol)))
        total += n
    assert 0.90 <= hits / total <= 0.98


@pytest.mark.parametrize("interaction", [0.0, 1.0])
def test_antithetic_orders_cut_the_error_at_the_same_number_of_orders(interaction):
    """On additive-ish games the marginal cost depends mostly on the position (who pays the intercept); an
    order and its reverse put each player at mirrored positions, so the pair's mean varies less."""
    rng = np.random.default_rng(12)
    squared = {True: [], False: []}
    for _ in range(300):
        n = int(rng.integers(4, 7))
        cost = synthetic_game(n, rng, interaction=interaction, noise=0.005)
        exact = exact_shapley(cost)
        for antithetic in (True, False):
            estimate = sampled_shapley(sample_orders(n, 8, rng, antithetic=antithetic), cost, antithetic=antithetic)["shapley_s"]
            squared[antithetic].append(np.mean((estimate - exact) ** 2) / cost[-1] ** 2)
    assert np.mean(squared[True]) < 0.8 * np.mean(squared[False])


def test_orders_are_checked():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="pairs"):
        sample_orders(5, 3, rng)
    assert sorted(sample_orders(5, 3, rng, antithetic=False)[0]) == list(range(5))


def test_serving_size_batches_are_measured_prefix_by_prefix_each_subset_once(tmp_path):
    """An additive engine with a known answer per order; the journal holds each distinct prefix once."""
    from llmvisor.errors import LlmvisorError
    from llmvisor.validation.analysis import analyse_sampled_batch
    from llmvisor.validation.measurement import Journal, measure_sampled
    from llmvisor.validation.plans import SampledKind, draw_sampled_batches
    from test_validation import ENVELOPE, B, GameEngine, additive_cost, known_model, mixes

    def cost(slices):  # decode cost free of context, since contexts grow while a batch is measured
        return additive_cost(slices) if slices[0].is_prefill else B + 5e-4 * len(slices)

    batches = draw_sampled_batches(mixes(), ENVELOPE, n_batches=2, n_orders=4, sizes=(16,),
                                   kinds=(SampledKind.DECODE, SampledKind.PREFILL))
    engine = GameEngine(cost)
    journal = Journal(tmp_path / "j.jsonl")
    counts = measure_sampled(engine, batches, journal, repeat=2, warm_up_steps=0)
    distinct = sum(len(b.subsets()) for b in batches)
    assert counts["measured_now"] == engine.n_steps == 2 * distinct  # the full batch, shared by every order, once
    again = measure_sampled(engine, batches, Journal(tmp_path / "j.jsonl"), repeat=2, warm_up_steps=0)
    assert again["measured_now"] == 0 and engine.n_steps == 2 * distinct
    for b in batches:
        record = analyse_sampled_batch(b, Journal(tmp_path / "j.jsonl"), known_model(d6=0.0), repeat=2)
        # The model prices this engine exactly, so with its game as control variate any orders give the exact
        # value (own + intercept / n) with no spread; without the control, whoever comes first pays the intercept.
        expected = np.array([cost([s]) - B for s in _slices(b)]) + B / b.size
        np.testing.assert_allclose(record["shapley_s"], expected, rtol=1e-9)
        np.testing.assert_allclose(record["shapley_ci95_s"][0], record["shapley_ci95_s"][1], rtol=1e-9)
        first = np.bincount([order[0] for order in b.orders], minlength=b.size) / len(b.orders)
        costs = {m: cost([_slices(b)[i] for i in members(m, b.size)]) for m in b.subsets()}
        np.testing.assert_allclose(sampled_shapley(np.array(b.orders), costs)["shapley_s"], expected - B / b.size + B * first, rtol=1e-9)
        assert sum(record["shares_s"]["token_count"]) == pytest.approx(record["measured_step_s"])
    with pytest.raises(LlmvisorError, match="mixed steps need a measurer"):
        measure_sampled(engine, draw_sampled_batches(mixes(), ENVELOPE, n_batches=1, n_orders=2, sizes=(16,), kinds=(SampledKind.MIXED,)),
                        journal, repeat=1)
    with pytest.raises(LlmvisorError, match="prepare_shared_decode"):
        measure_sampled(engine, draw_sampled_batches(mixes(), ENVELOPE, n_batches=1, n_orders=2, sizes=(16,),
                                                     kinds=(SampledKind.SHARED_PREFIX_DECODE,)), journal, repeat=1)


def _slices(batch):
    from llmvisor.engines.vllm.controlled import Slice

    return [Slice(n, c, p) for n, c, p in zip(batch.num_new_tokens, batch.num_context_tokens, batch.is_prefill)]


def test_an_additive_control_game_cuts_the_error_of_serving_size_estimates():
    """The model's additive game (intercept + own terms, exact Shapley own + intercept / n) as control variate:
    at 32 players and 8 orders the intercept, paid by whoever comes first, dominates the plain estimate's error."""
    rng = np.random.default_rng(5)
    n = 32
    own = rng.uniform(0.0002, 0.002, n)
    intercept = 0.02

    class Game:
        def __init__(self, noise_seed):
            self.cache, self.rng = {}, np.random.default_rng(noise_seed)

        def __getitem__(self, mask):
            if mask not in self.cache:
                m = members(mask, n)
                self.cache[mask] = 0.0 if not m else (intercept + own[m].sum() - 0.0002 * (len(m) - 1)) * (1 + 0.01 * self.rng.standard_normal())
            return self.cache[mask]

    class Model:
        def __getitem__(self, mask):
            m = members(mask, n)
            return 0.0 if not m else 0.9 * intercept + own[m].sum()

    model_shapley = own + 0.9 * intercept / n
    truth = own + (intercept - 0.0002 * (n - 1)) / n  # the pair saving is symmetric; noise aside, this is φ
    plain, controlled = [], []
    for trial in range(40):
        game = Game(trial)
        orders = sample_orders(n, 8, rng)
        plain.append(np.mean((sampled_shapley(orders, game)["shapley_s"] - truth) ** 2))
        result = sampled_shapley(orders, game, control=Model(), control_shapley=model_shapley)
        controlled.append(np.mean((result["shapley_s"] - truth) ** 2))
        assert result["shapley_s"].sum() == pytest.approx(game[(1 << n) - 1], rel=1e-9)
    assert np.mean(controlled) < 0.2 * np.mean(plain)
