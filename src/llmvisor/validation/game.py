"""Cooperative-game arithmetic on subset costs: the exact Shapley value, leave-one-out, an additive fit.

A game over n players is an array of 2**n costs indexed by bit mask (bit i = player i), ``cost[0] == 0``
for the empty subset. The validation measures such games on the real engine (every subset of a batch run
as one step) and prices them with the latency model.
"""

from __future__ import annotations

import math

import numpy as np


def subset_masks(n: int) -> np.ndarray:
    """Bit masks of every subset of n players, 0 (empty) to 2**n − 1 (everyone); bit i = player i."""
    return np.arange(1 << n, dtype=np.int64)


def popcount(masks: np.ndarray) -> np.ndarray:
    masks = np.asarray(masks, dtype=np.int64)
    return np.array([int(m).bit_count() for m in masks.ravel()], dtype=np.int64).reshape(masks.shape)


def members(subset: int, n: int) -> list[int]:
    """The players in ``subset`` (a bit mask over n players), in order."""
    return [i for i in range(n) if subset >> i & 1]


def check_game(cost: np.ndarray) -> int:
    """The number of players of a game, after checking it has 2**n costs and an empty subset costing 0."""
    cost = np.asarray(cost, dtype=np.float64)
    n = round(math.log2(cost.shape[0])) if cost.shape[0] else -1
    if n < 1 or cost.shape[0] != 1 << n:
        raise ValueError(f"a game over n players needs 2**n subset costs (got {cost.shape[0]})")
    if cost[0] != 0:
        raise ValueError("the cost of the empty subset must be 0")
    return n


def exact_shapley(cost: np.ndarray) -> np.ndarray:
    """Exact Shapley values from the cost of every subset (``cost[mask]``, ``cost[0] == 0``).

    φ_i = Σ_{S ∌ i} |S|!·(n−|S|−1)!/n! · (v(S ∪ {i}) − v(S)). They sum to v(everyone).
    """
    cost = np.asarray(cost, dtype=np.float64)
    n = check_game(cost)
    masks = subset_masks(n)
    sizes = popcount(masks)
    weight = np.array([math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) if s < n else 0.0 for s in range(n + 1)])
    phi = np.empty(n)
    for i in range(n):
        without = masks[(masks >> i) & 1 == 0]
        phi[i] = float(np.sum(weight[sizes[without]] * (cost[without | (1 << i)] - cost[without])))
    return phi


def leave_one_out(cost: np.ndarray) -> np.ndarray:
    """Leave-one-out marginal cost of each player: v(everyone) − v(everyone but i)."""
    cost = np.asarray(cost, dtype=np.float64)
    n = check_game(cost)
    full = (1 << n) - 1
    return np.array([cost[full] - cost[full ^ (1 << i)] for i in range(n)])


def additive_design(n: int) -> np.ndarray:
    """Design matrix of the additive game b + Σ_{i∈S} f_i over the non-empty subsets (rows in mask order)."""
    masks = subset_masks(n)[1:]
    return np.column_stack([np.ones(masks.size)] + [((masks >> i) & 1).astype(np.float64) for i in range(n)])


def additive_fit(cost: np.ndarray) -> dict:
    """Least-squares fit of the additive game v(S) = b + Σ_{i∈S} f_i to the measured non-empty subsets.

    Its Shapley values are f_i + b/n (own terms plus an equal split of the shared cost: the form the
    ``shapley`` rule assumes). The residual says how far the measured game is from any such form.
    """
    cost = np.asarray(cost, dtype=np.float64)
    n = check_game(cost)
    x = additive_design(n)
    coef, *_ = np.linalg.lstsq(x, cost[1:], rcond=None)
    residual = cost[1:] - x @ coef
    full = cost[-1]
    return {
        "intercept_s": float(coef[0]),
        "own_s": coef[1:].tolist(),
        "shapley_s": (coef[1:] + coef[0] / n).tolist(),
        "rms_residual_fraction": float(np.sqrt(np.mean(residual**2)) / full) if full > 0 else float("nan"),
        "max_residual_fraction": float(np.max(np.abs(residual)) / full) if full > 0 else float("nan"),
    }
