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


EXACT_MAX_PLAYERS = 6
"""Exact enumeration (2**n − 1 measured subsets) up to this batch size; larger batches are sampled by orders."""


def sample_orders(n: int, n_orders: int, rng: np.random.Generator, *, antithetic: bool = True) -> np.ndarray:
    """Random orders of n players, one per row; antithetic: rows come in pairs, an order then its reverse.

    A player late in one order is early in its reverse, so a marginal cost that grows or falls with how many
    players came before (a shared intercept, a cost in the batch size) largely cancels within a pair.
    """
    if n < 1 or n_orders < 1:
        raise ValueError(f"need at least one player and one order (got {n} players, {n_orders} orders)")
    if antithetic and n_orders % 2:
        raise ValueError(f"antithetic orders come in pairs (got {n_orders} orders)")
    if not antithetic:
        return np.array([rng.permutation(n) for _ in range(n_orders)], dtype=np.int64).reshape(n_orders, n)
    first = np.array([rng.permutation(n) for _ in range(n_orders // 2)], dtype=np.int64).reshape(n_orders // 2, n)
    return np.stack([first, first[:, ::-1]], axis=1).reshape(n_orders, n)


def prefix_masks(orders: np.ndarray) -> np.ndarray:
    """Bit mask of each prefix of each order: ``[k, j]`` = the first j + 1 players of order k (unsigned: a batch
    of 64 players fills all 64 bits)."""
    orders = np.asarray(orders, dtype=np.uint64)
    if orders.size and int(orders.max()) >= 64:
        raise ValueError(f"bit masks hold at most 64 players (got a player {int(orders.max())})")
    return np.cumsum(np.left_shift(np.uint64(1), orders), axis=1, dtype=np.uint64)


def subsets_to_measure(orders: np.ndarray) -> list[int]:
    """The distinct non-empty subsets the orders' prefixes visit (each measured once, however many orders share it)."""
    return sorted({int(m) for m in prefix_masks(orders).ravel()})


def order_marginals(orders: np.ndarray, cost) -> np.ndarray:
    """``[k, i]``: player i's marginal cost in order k, v(prefix ∪ i) − v(prefix); ``cost[mask]`` gives v (v(∅) = 0)."""
    orders = np.asarray(orders, dtype=np.int64)
    masks = prefix_masks(orders)
    values = np.array([[float(cost[int(m)]) for m in row] for row in masks]).reshape(masks.shape)
    steps = np.diff(values, axis=1, prepend=0.0)
    out = np.empty(orders.shape)
    np.put_along_axis(out, orders, steps, axis=1)
    return out


def sampled_shapley(orders: np.ndarray, cost, *, antithetic: bool = True, confidence: float = 0.95,
                    control=None, control_shapley=None) -> dict:
    """Shapley values estimated from sampled orders, with a per-player standard error and interval.

    Each order's marginals sum to v(everyone), so the estimate does too. The independent units are the orders
    (or, antithetic, the pairs of an order and its reverse); the interval is Student-t over those units.

    ``control`` (a game of the same players, ``control[mask]``) with its exact Shapley values ``control_shapley``
    is a control variate: the orders then estimate only φ(cost) − φ(control), whose marginals vary far less when
    the control is close (the latency model's own game: a shared intercept paid by whoever comes first is the
    largest spread of the plain estimate, and the control takes it out).
    """
    from scipy import stats

    marginals = order_marginals(orders, cost)
    if control is not None:
        marginals = marginals - order_marginals(orders, control) + np.asarray(control_shapley, dtype=np.float64)
    units = marginals.reshape(-1, 2, marginals.shape[1]).mean(axis=1) if antithetic else marginals
    n_units = units.shape[0]
    estimate = units.mean(axis=0)
    std_err = units.std(axis=0, ddof=1) / math.sqrt(n_units) if n_units > 1 else np.full(estimate.size, np.inf)
    half = float(stats.t.ppf(0.5 + confidence / 2, n_units - 1)) * std_err if n_units > 1 else std_err
    return {
        "shapley_s": estimate,
        "std_err_s": std_err,
        "ci_low_s": estimate - half,
        "ci_high_s": estimate + half,
        "confidence": confidence,
        "n_orders": int(marginals.shape[0]),
        "n_units": int(n_units),
        "antithetic": antithetic,
    }
