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


def coalition_indicators(masks, n: int) -> np.ndarray:
    """``[k, i]`` = 1.0 when player i is in coalition k (bit masks over n ≤ 64 players, any subsets, repeats allowed)."""
    if not 1 <= n <= 64:
        raise ValueError(f"bit masks hold 1 to 64 players (got {n})")
    masks = np.array([int(m) for m in masks], dtype=np.uint64)
    return ((masks[:, None] >> np.arange(n, dtype=np.uint64)) & np.uint64(1)).astype(np.float64)


def regression_shapley(masks, cost_s, n: int, *, weights=None, control=None, control_shapley=None, blocks=None,
                       confidence: float = 0.95) -> dict:
    """Shapley values by least squares over measured coalitions: v(S) = b + Σ_{i∈S} f_i, φ_i = f_i + b/n.

    Every measured step counts (a permutation estimate spends each step on one marginal). ``masks[k]`` is the
    coalition of measured time ``cost_s[k]``: any non-empty subsets, repeats allowed; the full batch must be among
    them, since the fit is held to efficiency, Σφ = b + Σf = the mean of the full batch's measurements (constrained
    least squares, solved through its KKT system). The estimate is linear in the measurements, φ̂ = A·y, so its
    covariance is σ²·A·W⁻¹·Aᵀ, σ² the residual variance per step (per unit weight), taken with the residual's
    effective degrees of freedom; intervals are Student-t on those.

    ``weights``: inverse variance of each measurement up to one common factor (e.g. 1/T̂(S)² for noise relative to
    the step time; None: equal). ``control`` (``control[mask]``: a cost game of the same players, the latency
    model's) with its Shapley values ``control_shapley``: the fit is then of v − control and the control's values
    are added back; it changes the estimate only where the control game is not itself additive.
    ``blocks`` (one label per measurement, e.g. the batch-round it was measured in): each block other than the full
    batch's first gets an offset of its own, a nuisance the values exclude, so that a machine drifting between
    rounds neither biases the values nor hides as independent noise.

    Valid where the measured game is additive within noise (`additivity_test`); elsewhere it estimates the Shapley
    values of the additive game closest to the measurements, and its residual variance grows with the misfit.
    """
    from scipy import stats

    masks = [int(m) for m in masks]
    y = np.asarray(cost_s, dtype=np.float64).ravel()
    if len(masks) != y.size or y.size == 0:
        raise ValueError(f"one measured time per coalition (got {len(masks)} coalitions, {y.size} times)")
    full = (1 << n) - 1
    if any(m <= 0 or m > full for m in masks):
        raise ValueError(f"coalitions must be non-empty subsets of {n} players")
    is_full = np.array([m == full for m in masks])
    if not is_full.any():
        raise ValueError("the full batch must be measured: its time is what the values add up to")
    if control is not None:
        y = y - np.array([float(control[m]) for m in masks])
    w = np.ones(y.size) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if w.size != y.size or not np.all(w > 0):
        raise ValueError("weights: one positive weight per measurement")
    x = np.column_stack([np.ones(y.size), coalition_indicators(masks, n)])
    if np.linalg.matrix_rank(x.T @ x) < n + 1:
        raise ValueError(f"the measured coalitions do not tell the {n} players apart (each must be in some and out of others)")
    if blocks is not None:
        labels = list(blocks)
        if len(labels) != y.size:
            raise ValueError(f"blocks: one label per measurement (got {len(labels)} for {y.size})")
        reference = labels[int(np.argmax(is_full))]
        others = [b for b in dict.fromkeys(labels) if b != reference]
        x = np.column_stack([x] + [np.array([lab == b for lab in labels], dtype=np.float64) for b in others])
        if np.linalg.matrix_rank(x.T @ x) < x.shape[1]:
            raise ValueError("blocks: the coalitions within the blocks do not separate the blocks' offsets from the players")
    p = x.shape[1]
    u = is_full / is_full.sum()
    kkt = np.zeros((p + 1, p + 1))
    kkt[:p, :p] = x.T @ (w[:, None] * x)
    kkt[:p, p] = kkt[p, :p] = np.r_[np.ones(n + 1), np.zeros(p - n - 1)]
    rhs = np.vstack([x.T * w, u])
    g = np.linalg.solve(kkt, rhs)[:p]
    beta = g @ y
    to_shapley = np.column_stack([np.full(n, 1.0 / n), np.eye(n), np.zeros((n, p - n - 1))])
    a = to_shapley @ g
    residual = y - x @ beta
    # E[Σ w·r²] = σ²·tr(W·R·W⁻¹·Rᵀ), R = I − X·G: M − 2·tr(G·X) + tr(XᵀWX · G·W⁻¹·Gᵀ), without the M × M matrix
    dof = float(y.size - 2 * np.trace(g @ x) + np.sum(kkt[:p, :p] * ((g / w) @ g.T)))
    sigma2 = float(residual @ (w * residual)) / dof if dof > 1e-9 else math.inf
    cov = sigma2 * (a / w) @ a.T if math.isfinite(sigma2) else np.full((n, n), math.inf)
    phi = a @ y
    if control is not None:
        phi = phi + np.asarray(control_shapley, dtype=np.float64)
    std_err = np.sqrt(np.maximum(np.diag(cov), 0.0))
    half = float(stats.t.ppf(0.5 + confidence / 2, dof)) * std_err if dof > 1e-9 else std_err
    return {
        "shapley_s": phi,
        "std_err_s": std_err,
        "ci_low_s": phi - half,
        "ci_high_s": phi + half,
        "cov_s2": cov,
        "intercept_s": float(beta[0]),
        "own_s": beta[1 : n + 1],
        "block_offsets_s": beta[n + 1 :],
        "sigma2": sigma2,
        "residual_dof": dof,
        "n_measurements": int(y.size),
        "n_coalitions": len(set(masks)),
        "confidence": confidence,
    }


def additivity_test(masks, cost_s, n: int, *, weights=None, noise_var=None, noise_dof=None, alpha: float = 0.05) -> dict:
    """Lack-of-fit F-test of the additive game b + Σ_{i∈S} f_i against the measurement noise.

    The additive game is fitted by (weighted) least squares to every measurement; what it leaves is compared with
    the noise. The noise is the pure error of repeated measurements of the same coalitions where the measurements
    have repeats (``noise_source`` "replicates": F = (SS_lack-of-fit / (D − n − 1)) / (SS_pure / (M − D)), D distinct
    coalitions, M measurements); otherwise the given ``noise_var`` (per unit weight, estimated on ``noise_dof``
    degrees of freedom, None: known): F = (SS_residual / (M − n − 1)) / noise_var ("external"). Rejected at
    ``alpha``: the game is not additive within that noise, and a regression's values are of the nearest additive
    game only. ``interaction_rms`` is the root mean square, per measurement and unit weight, of what the misfit adds
    beyond the noise: √(max(0, SS_residual − (M − n − 1)·noise) / M) (0 when the misfit is within the noise).
    """
    from scipy import stats

    masks = [int(m) for m in masks]
    y = np.asarray(cost_s, dtype=np.float64).ravel()
    w = np.ones(y.size) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    x = np.column_stack([np.ones(y.size), coalition_indicators(masks, n)])
    sw = np.sqrt(w)
    coef, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
    rank = int(np.linalg.matrix_rank(x))
    ss_res = float(np.sum(w * (y - x @ coef) ** 2))
    groups: dict[int, list[int]] = {}
    for k, m in enumerate(masks):
        groups.setdefault(m, []).append(k)
    distinct = len(groups)
    ss_pure = 0.0
    for rows in groups.values():
        rows = np.array(rows)
        mean = float(np.sum(w[rows] * y[rows]) / np.sum(w[rows]))
        ss_pure += float(np.sum(w[rows] * (y[rows] - mean) ** 2))
    dof_pure = y.size - distinct
    out = {"n_measurements": int(y.size), "n_coalitions": distinct, "n_parameters": rank}
    if dof_pure > 0 and noise_var is None:
        dof_lof = distinct - rank
        source, noise, noise_dof = "replicates", ss_pure / dof_pure, float(dof_pure)
        num_dof, num = dof_lof, (ss_res - ss_pure) / dof_lof if dof_lof > 0 else math.nan
    elif noise_var is not None:
        source, noise = "external", float(noise_var)
        num_dof = y.size - rank
        num = ss_res / num_dof if num_dof > 0 else math.nan
    else:
        raise ValueError("no repeated coalitions to take the pure error from, and no noise_var given")
    if num_dof <= 0 or not noise > 0:
        f_stat = p_value = math.nan
    else:
        f_stat = num / noise
        denominator_dof = math.inf if noise_dof is None else float(noise_dof)
        p_value = float(stats.chi2.sf(f_stat * num_dof, num_dof) if math.isinf(denominator_dof)
                        else stats.f.sf(f_stat, num_dof, denominator_dof))
    return {
        **out,
        "noise_source": source,
        "noise_var": noise,
        "noise_dof": noise_dof,
        "misfit_var": num,
        "misfit_dof": num_dof,
        "f": f_stat,
        "p_value": p_value,
        "rejected": bool(p_value < alpha) if math.isfinite(p_value) else None,
        "alpha": alpha,
        "interaction_rms": math.sqrt(max(0.0, ss_res - (y.size - rank) * noise) / y.size),
        "coef": coef,
    }


def shapley_kernel_size_weights(n: int) -> np.ndarray:
    """The Shapley kernel's distribution of coalition sizes 1..n − 1: p(s) ∝ (n − 1) / (s·(n − s)) (Lundberg & Lee 2017)."""
    if n < 2:
        raise ValueError(f"the Shapley kernel needs at least 2 players (got {n})")
    s = np.arange(1, n, dtype=np.float64)
    p = 1.0 / (s * (n - s))
    return p / p.sum()


def sample_kernel_pairs(n: int, n_pairs: int, rng: np.random.Generator) -> list[int]:
    """``n_pairs`` coalitions drawn from the Shapley kernel (a size by `shapley_kernel_size_weights`, then a subset of
    that size uniformly), each followed by its complement: ``[S₁, B∖S₁, S₂, B∖S₂, ...]`` (paired sampling)."""
    full = (1 << n) - 1
    sizes = rng.choice(np.arange(1, n), size=n_pairs, p=shapley_kernel_size_weights(n))
    out = []
    for s in sizes:
        mask = sum(1 << int(i) for i in rng.choice(n, size=int(s), replace=False))
        out += [mask, full ^ mask]
    return out


def kernel_shap(masks, cost_s, n: int, *, full_cost_s: float, confidence: float = 0.95) -> dict:
    """Unbiased KernelSHAP with paired sampling (Covert & Lee, "Improving KernelSHAP", AISTATS 2021), and its variance.

    ``masks`` as `sample_kernel_pairs` draws them (a coalition, then its complement), ``cost_s`` their measured
    times, ``full_cost_s`` the full batch's. With A = E[z zᵀ] under the kernel (known in closed form) and b̂ the mean
    over pairs of ½(z·v(z) + (1 − z)·v(1 − z)), φ̂ = A⁻¹(b̂ − 1·(1ᵀA⁻¹b̂ − v(B)) / 1ᵀA⁻¹1): unbiased for the Shapley
    value of the measured game whatever its form (no additivity assumed), Σφ̂ = v(B), and Cov(φ̂) = C·Cov(b̂)·Cᵀ with
    C = A⁻¹ − A⁻¹11ᵀA⁻¹ / 1ᵀA⁻¹1 and Cov(b̂) the pairs' sample covariance over their number. The fallback where
    `additivity_test` rejects the additive game; far wider than `regression_shapley` where that game holds.
    """
    from scipy import stats

    y = np.asarray(cost_s, dtype=np.float64).ravel()
    masks = [int(m) for m in masks]
    if len(masks) != y.size or y.size < 4 or y.size % 2:
        raise ValueError(f"paired coalitions: an even number, at least 2 pairs, one time each (got {len(masks)}, {y.size})")
    full = (1 << n) - 1
    if any(a ^ b != full for a, b in zip(masks[::2], masks[1::2])):
        raise ValueError("each coalition must be followed by its complement (paired sampling)")
    p = shapley_kernel_size_weights(n)
    s = np.arange(1, n, dtype=np.float64)
    off = float(np.sum(p * s * (s - 1))) / (n * (n - 1)) if n > 1 else 0.0
    a = np.full((n, n), off)
    np.fill_diagonal(a, 0.5)
    a_inv = np.linalg.inv(a)
    ones = np.ones(n)
    z = coalition_indicators(masks, n)
    units = 0.5 * (z[::2] * y[::2, None] + z[1::2] * y[1::2, None])
    n_pairs = units.shape[0]
    b_hat = units.mean(axis=0)
    denom = float(ones @ a_inv @ ones)
    phi = a_inv @ (b_hat - ones * (float(ones @ a_inv @ b_hat) - full_cost_s) / denom)
    c = a_inv - np.outer(a_inv @ ones, ones @ a_inv) / denom
    cov = c @ (np.cov(units, rowvar=False) / n_pairs) @ c.T
    std_err = np.sqrt(np.maximum(np.diag(cov), 0.0))
    half = float(stats.t.ppf(0.5 + confidence / 2, n_pairs - 1)) * std_err
    return {"shapley_s": phi, "std_err_s": std_err, "ci_low_s": phi - half, "ci_high_s": phi + half, "cov_s2": cov,
            "n_pairs": n_pairs, "confidence": confidence}
