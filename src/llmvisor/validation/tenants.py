"""Ground truth at the level bills are paid: the tenants' game, measured exactly, against each tenant's bill.

A tenants-design batch (`llmvisor.validation.plans.draw_tenant_batches`) holds 2–4 unequal tenants; a coalition of
tenants is all their requests together, so the tenants' game has only 2**T − 1 coalitions and is measured exactly,
each coalition ``repeat`` times per round, in independent rounds. A tenant's bill is the sum of its requests' shares
under a rule (``shapley``: the landed rule and sharing rule; `token_count` and `equal_split` beside it), so its truth
is the sum of its requests' Shapley values, which the tenants' game gives where it is additive over tenants
(`tenant_game_values`: its own terms F_t plus the shared cost split per request; the exact Shapley value of the
tenants' game, which splits the shared cost per tenant, is kept beside it). Intervals come from the repeats.

From journals measured before this design (per-request coalitions, `llmvisor.validation.coalitions`) a tenant's
interval follows from the regression's covariance: a tenant owning a quarter of a batch has the variance 1ᵀΣ1 over
its requests (`quarter_tenant_halfwidths`). That is what the old data supports; the measured tenants' game is what
the tenants design adds.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from llmvisor.validation.analysis import Method, quantiles_with_ci, token_count_split
from llmvisor.validation.coalitions import LANDED_SHARING_RULE, sharing_rule_shares
from llmvisor.validation.estimator import shapley_matrix
from llmvisor.validation.game import additive_design, additivity_test, exact_shapley, members
from llmvisor.validation.measurement import Journal
from llmvisor.validation.plans import SampledBatchSpec, TenantRole, tenant_coalition_masks

HALFWIDTH_GOAL = 0.25
"""Issue #39's goal: a tenant's median 95% half-width at most this fraction of its share, at 32 and 64 requests."""
GOAL_SIZES = (32, 64)
BILL_METHODS = (Method.SHAPLEY.value, Method.TOKEN_COUNT.value, Method.EQUAL_SPLIT.value)


def tenant_game_values(times: list[np.ndarray], n_tenants: int, tenant_requests, *, confidence: float = 0.95) -> dict:
    """The truths of a tenants' game from repeated measurements: ``times[c − 1]`` holds coalition c's measured times
    (c a bit mask over tenants), ``tenant_requests`` each tenant's number of requests.

    - ``shapley_s``: each tenant's share of the batch as its requests' Shapley values summed, which is what a bill
      built from per-request shares claims: with the tenants' game additive, v(C) = b + Σ_{t∈C} F_t (fitted by least
      squares to the mean times; exact for two tenants), that sum is F_t + b·n_t / n (the shared cost split per
      request). Where requests share blocks only within their tenant, this holds whatever the requests' own game.
    - ``tenant_game_shapley_s``: the exact Shapley value of the tenants' game (tenants as players: the shared cost
      split per tenant, not per request; not what a per-request bill is meant to equal).

    Both are linear in the mean times: variance Σ_c L_tc²·s_c²/k_c (s_c² coalition c's sample variance over its k_c
    repeats), Student-t with Welch–Satterthwaite degrees of freedom."""
    if len(times) != (1 << n_tenants) - 1 or any(np.asarray(t).size < 2 for t in times):
        raise ValueError(f"a game of {n_tenants} tenants needs {(1 << n_tenants) - 1} coalitions with 2 or more times each")
    counts = np.asarray(tenant_requests, dtype=np.float64)
    mean = np.array([float(np.mean(t)) for t in times])
    var_of_mean = np.array([float(np.var(t, ddof=1)) / np.asarray(t).size for t in times])
    dof_each = np.array([np.asarray(t).size - 1 for t in times], dtype=np.float64)
    pinv = np.linalg.pinv(additive_design(n_tenants))
    linear = {"shapley_s": pinv[1:] + np.outer(counts / counts.sum(), pinv[0]), "tenant_game_shapley_s": shapley_matrix(n_tenants)}
    out: dict = {"cost_s": mean, "shared_s": float(pinv[0] @ mean)}
    for name, matrix in linear.items():
        parts = matrix**2 * var_of_mean
        var = parts.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            dof = np.where(var > 0, var**2 / np.sum(parts**2 / dof_each, axis=1), np.inf)
        prefix = name.removesuffix("shapley_s")
        out[name] = matrix @ mean
        out[f"{prefix}half_s"] = stats.t.ppf(0.5 + confidence / 2, np.maximum(dof, 1.0)) * np.sqrt(var)
        out[f"{prefix}std_err_s"] = np.sqrt(var)
    assert np.allclose(out["tenant_game_shapley_s"], exact_shapley(np.concatenate([[0.0], mean])))
    if n_tenants > 2:
        masks = np.repeat(np.arange(1, 1 << n_tenants), [np.asarray(t).size for t in times])
        out["additivity"] = additivity_test(masks, np.concatenate([np.asarray(t, dtype=np.float64) for t in times]), n_tenants)
    return out


def tenant_sums(values, tenants, n_tenants: int) -> np.ndarray:
    """Per tenant, the sum of its requests' ``values``."""
    return np.bincount(np.asarray(tenants), weights=np.asarray(values, dtype=np.float64), minlength=n_tenants)


def analyse_tenant_batch(batch: SampledBatchSpec, journal: Journal, model, *, confidence: float = 0.95) -> dict | None:
    """One tenants-design batch: each tenant's truth (`tenant_game_values`: its requests' Shapley values summed, and the
    tenants' game's own Shapley value beside it) with its interval (every round's clean repeats pooled) and its bill
    under each method and sharing rule; the rounds' truths apart (their spread is the round-to-round noise);
    None until round 0 is measured. Steps the interference guard kept after every redo was disturbed are left out."""
    n_tenants = len(batch.tenant_roles)
    coalitions = tenant_coalition_masks(batch.tenants)  # tenant masks 2**T − 1 … 1
    by_tenant_mask = {(1 << n_tenants) - 1 - k: mask for k, mask in enumerate(coalitions)}
    rounds: list[list[np.ndarray]] = []
    n_disturbed = 0
    for round_ in range(batch.rounds):
        taken = [journal.get(batch, round_, by_tenant_mask[c]) for c in range(1, 1 << n_tenants)]
        if not all(taken):  # not measured yet
            if round_ == 0:
                return None
            break
        n_disturbed += sum(m.interference for ms in taken for m in ms)
        rounds.append([np.array([m.step_latency_s for m in ms if not m.interference]) for ms in taken])
    pooled = [np.concatenate([r[c] for r in rounds]) for c in range((1 << n_tenants) - 1)]
    base = {"index": batch.index, "kind": batch.kind, "size": batch.size, "n_tenants": n_tenants, "roles": list(batch.tenant_roles),
            "n_disturbed_steps": n_disturbed}
    if any(t.size < 2 for t in pooled):
        return {**base, "interference_flagged": True}
    counts = np.bincount(np.asarray(batch.tenants), minlength=n_tenants)
    game = tenant_game_values(pooled, n_tenants, counts, confidence=confidence)
    full = (1 << batch.size) - 1
    full_taken = [m for r in range(len(rounds)) for m in journal.get(batch, r, full) if not m.interference]
    measured_s = float(np.mean([m.step_latency_s for m in full_taken]))
    contexts: list[list[int]] = [[] for _ in range(batch.size)]
    for r in range(len(rounds)):
        for mask in coalitions:
            for m in journal.get(batch, r, mask):
                for i, c in zip(members(mask, batch.size), m.num_context_tokens, strict=False):
                    contexts[i].append(c)
    context = np.rint(np.array([np.mean(c) if c else nominal for c, nominal in zip(contexts, batch.num_context_tokens, strict=True)]))
    recorded = [m.num_shared_context_tokens for m in full_taken if m.num_shared_context_tokens is not None]
    shared = np.median(np.array(recorded, dtype=np.float64), axis=0) if recorded else np.zeros(batch.size)
    new = np.array(batch.num_new_tokens, dtype=np.float64)
    is_prefill = np.array(batch.is_prefill, dtype=bool)
    rules = sharing_rule_shares(model, new, context, is_prefill, measured_s, shared, batch.groups)
    request_shares = {Method.SHAPLEY.value: rules[LANDED_SHARING_RULE], Method.TOKEN_COUNT.value: measured_s * token_count_split(new, is_prefill),
                      Method.EQUAL_SPLIT.value: np.full(batch.size, measured_s / batch.size)}
    bills = {m: tenant_sums(v, batch.tenants, n_tenants) for m, v in request_shares.items()}
    pinv = np.linalg.pinv(additive_design(n_tenants))
    by_round = [(pinv[1:] + np.outer(counts / counts.sum(), pinv[0])) @ np.array([float(np.mean(t)) for t in r])
                for r in rounds if all(t.size for t in r)]
    return {
        **base, "interference_flagged": False, "phase": "prefill" if is_prefill.all() else "decode",
        "n_steps": int(sum(t.size for t in pooled)), "n_rounds": len(rounds), "measured_step_s": measured_s,
        "tenant_requests": counts.tolist(), "shared_s": game["shared_s"],
        "shapley_s": game["shapley_s"], "half_s": game["half_s"], "std_err_s": game["std_err_s"],
        "tenant_game_shapley_s": game["tenant_game_shapley_s"], "tenant_game_half_s": game["tenant_game_half_s"],
        "additivity": {k: game["additivity"][k] for k in ("f", "p_value", "rejected")} if "additivity" in game else None,
        "shapley_by_round_s": [p.tolist() for p in by_round],
        "bills_s": bills, "sharing_rule_bills_s": {rule: tenant_sums(v, batch.tenants, n_tenants) for rule, v in rules.items()},
    }


def tenant_rows(records: list[dict]) -> list[dict]:
    """One row per tenant of every usable record: its size, phase, role, sharing class, errors and half-width."""
    rows = []
    for r in records:
        if r.get("interference_flagged"):
            continue
        for t, role in enumerate(r["roles"]):
            phi, half = float(r["shapley_s"][t]), float(r["half_s"][t])
            bill = float(r["bills_s"][Method.SHAPLEY.value][t])
            rows.append({
                "batch": r["index"], "size": r["size"], "phase": r["phase"], "role": role, "n_tenants": r["n_tenants"],
                "sharing_class": "sharing" if role == TenantRole.SHARING else "own",
                "halfwidth_over_share": half / bill if bill > 0 else math.inf,
                "bill_in_interval": abs(bill - phi) <= half,
                "errors": {m: abs(float(r["bills_s"][m][t]) - phi) / phi if phi > 0 else math.inf for m in r["bills_s"]},
                "rule_errors": {rule: abs(float(b[t]) - phi) / phi if phi > 0 else math.inf for rule, b in r["sharing_rule_bills_s"].items()},
            })
    return rows


def _median_ci(values: np.ndarray, groups: np.ndarray, *, n_bootstrap: int, seed: int) -> dict:
    """Median with a batch-clustered bootstrap 95% interval (`quantiles_with_ci`)."""
    q = quantiles_with_ci(values, groups, qs=(50,), n_bootstrap=n_bootstrap, seed=seed)
    return {"p50": q["p50"], "p50_ci95": q["p50_ci95"], "n": q["n"]}


def _block(rows: list[dict], *, n_bootstrap: int, seed: int) -> dict:
    groups = np.array([r["batch"] for r in rows])
    errors = {m: quantiles_with_ci(np.array([r["errors"][m] for r in rows]), groups, qs=(50, 90), n_bootstrap=n_bootstrap, seed=seed)
              for m in BILL_METHODS if all(m in r["errors"] for r in rows)}
    half = _median_ci(np.array([r["halfwidth_over_share"] for r in rows]), groups, n_bootstrap=n_bootstrap, seed=seed)
    return {"n_tenants": len(rows), "n_batches": len(set(groups.tolist())), "halfwidth_over_share": half,
            "relative_error": errors, "bill_within_interval_fraction": float(np.mean([r["bill_in_interval"] for r in rows]))}


def tenant_summary(records: list[dict], *, n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """The per-tenant figures: per size (the headline: "a tenant's bill is within X% of its measured Shapley value",
    X the p90 of |bill − φ| ÷ φ, with the median 95% half-width ÷ share beside it), per phase, role and sharing class;
    each sharing rule's p90 error where a tenant shares a document; the issue's goal per size."""
    rows = tenant_rows(records)
    if not rows:
        return {"n_batches": 0, "n_interference_flagged": sum(1 for r in records if r.get("interference_flagged"))}
    by = {key: {str(v): _block([r for r in rows if r[key] == v], n_bootstrap=n_bootstrap, seed=seed)
                for v in sorted({r[key] for r in rows})}
          for key in ("size", "phase", "role", "sharing_class")}
    goal = {}
    for size, block in by["size"].items():
        half = block["halfwidth_over_share"]["p50"]
        goal[size] = {"halfwidth_over_share_p50": half, "met": half <= HALFWIDTH_GOAL, "judged": int(size) in GOAL_SIZES,
                      "within_pct_p90": block["relative_error"][Method.SHAPLEY.value]["p90"],
                      "within_pct_p90_ci95": block["relative_error"][Method.SHAPLEY.value]["p90_ci95"]}
    sharing_rows = [r for r in rows if r["sharing_class"] == "sharing"]
    rules = {}
    if sharing_rows:
        groups = np.array([r["batch"] for r in sharing_rows])
        for rule in sharing_rows[0]["rule_errors"]:
            rules[rule] = quantiles_with_ci(np.array([r["rule_errors"][rule] for r in sharing_rows]), groups, qs=(50, 90),
                                            n_bootstrap=n_bootstrap, seed=seed)
    tested = [r["additivity"] for r in records if not r.get("interference_flagged") and r.get("additivity")]
    return {
        "n_batches": len({r["batch"] for r in rows}), "n_tenants": len(rows),
        "tenant_additivity": {"n_batches": len(tested), "rejected_fraction_5pct": float(np.mean([a["rejected"] for a in tested])) if tested else None},
        "n_interference_flagged": sum(1 for r in records if r.get("interference_flagged")),
        "headline_method": Method.SHAPLEY.value, "by_size": by["size"], "by_phase": by["phase"], "by_role": by["role"],
        "by_sharing_class": by["sharing_class"], "sharing_tenant_by_rule": rules,
        "goal": {"halfwidth_over_share_max": HALFWIDTH_GOAL, "sizes": list(GOAL_SIZES), "by_size": goal,
                 "met": all(goal.get(str(s), {}).get("met", False) for s in GOAL_SIZES)},
        "how": "per tenant: |bill − measured Shapley| ÷ measured Shapley (bill: the sum of its requests' shares, scaled to "
        "the measured step), quantiles with batch-clustered bootstrap 95% intervals; half-width: the 95% interval of the "
        "measured value from the repeats, ÷ the tenant's `shapley` bill",
    }


def quarter_tenant_halfwidths(records: list[dict], *, draws: int = 20, n_bootstrap: int = 1000, seed: int = 0,
                              confidence: float = 0.95) -> dict:
    """What a per-request coalitions journal supports per tenant: each serving-size batch split ``draws`` times into
    four random quarters, each quarter a tenant; its 95% half-width t·√(1ᵀΣ1) (Σ the regression's covariance of the
    quarter's requests, t on the batch's residual degrees of freedom) ÷ its `shapley` bill, and |bill − estimate| ÷
    estimate. Medians per size and kind with batch-clustered bootstrap intervals (the draws of a batch are one
    cluster); prefix groups of mixed-sharing batches as tenants beside them."""
    rng = np.random.default_rng([seed, 39, 4])
    rows = []
    for r in records:
        if r.get("interference_flagged") or r.get("exact"):
            continue
        n, cov = r["size"], np.asarray(r["cov_s2"])
        share = np.asarray(r["shares_s"][Method.SHAPLEY.value])
        phi = np.asarray(r["shapley_s"])
        t = float(stats.t.ppf(0.5 + confidence / 2, r["residual_dof"]))
        tenants = [("quarter", p) for _ in range(draws) for p in np.array_split(rng.permutation(n), 4)]
        if r["kind"] == "mixed_sharing_decode":  # a shared-prefix batch's one group is the whole batch
            groups = np.asarray(r["groups"])
            tenants += [("prefix_group", np.flatnonzero(groups == g)) for g in sorted(set(groups.tolist()) - {-1})]
        for how, p in tenants:
            bill, value = float(share[p].sum()), float(phi[p].sum())
            rows.append({"how": how, "size": n, "kind": r["kind"], "batch": r["index"],
                         "half": t * math.sqrt(max(float(cov[np.ix_(p, p)].sum()), 0.0)) / bill,
                         "error": abs(bill - value) / value if value > 0 else math.inf})
    out: dict = {}
    for how in ("quarter", "prefix_group"):
        chosen = [x for x in rows if x["how"] == how]
        entry: dict = {}
        for size in sorted({x["size"] for x in chosen}):
            sized = [x for x in chosen if x["size"] == size]
            groups = np.array([x["batch"] for x in sized])
            entry[str(size)] = {
                "n_batches": len(set(groups.tolist())), "n_tenants": len(sized),
                "halfwidth_over_share": _median_ci(np.array([x["half"] for x in sized]), groups, n_bootstrap=n_bootstrap, seed=seed),
                "error_vs_estimate": quantiles_with_ci(np.array([x["error"] for x in sized]), groups, qs=(50, 90), n_bootstrap=n_bootstrap, seed=seed),
                "by_kind": {k: float(np.median([x["half"] for x in sized if x["kind"] == k])) for k in sorted({x["kind"] for x in sized})},
            }
        out[how] = entry
    out["how"] = (f"quarter: each serving-size batch split {draws} times into four random quarters; prefix_group: each prefix "
                  "group of a mixed-sharing batch; half-width t·√(1ᵀΣ1) over the tenant's requests (the regression's "
                  "covariance) ÷ its `shapley` bill; error: |bill − Σ estimate| ÷ Σ estimate, which holds the estimate's "
                  "own noise")
    return out


def bootstrap_median_ratio(numerator: list[np.ndarray], denominator: list[np.ndarray], *, n_bootstrap: int = 1000,
                           seed: int = 0) -> dict:
    """median(numerator) ÷ median(denominator) of two independent sets of batches (each a list of per-request values),
    with a bootstrap 95% interval resampling each set's batches on its own."""
    rng = np.random.default_rng([seed, 39, 2])

    def median(batches: list[np.ndarray], pick) -> float:
        return float(np.median(np.concatenate([batches[i] for i in pick])))

    ratios = [median(numerator, rng.integers(0, len(numerator), len(numerator))) /
              median(denominator, rng.integers(0, len(denominator), len(denominator))) for _ in range(n_bootstrap)]
    low, high = np.percentile(ratios, [2.5, 97.5]) if ratios else (math.nan, math.nan)
    return {"ratio": median(numerator, range(len(numerator))) / median(denominator, range(len(denominator))),
            "ci95": [float(low), float(high)], "n_batches_numerator": len(numerator), "n_batches_denominator": len(denominator)}


def _pct(value: float | None) -> str:
    """A fraction as a percentage; "–" where there is none (too few tenants for the quantile or its interval)."""
    return "–" if value is None else f"{100 * value:.1f}%"


def _pct_ci(block: dict, key: str) -> str:
    ci = block.get(f"{key}_ci95")
    return _pct(block.get(key)) + (f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci and None not in ci else "")


def headline_sentences(summary: dict) -> list[str]:
    """The per-tenant headline, one sentence per size, from `tenant_summary`'s result: what `llmvisor validate`
    prints and docs/validation.md quotes."""
    out = []
    for size, block in (summary.get("by_size") or {}).items():
        err = block["relative_error"][Method.SHAPLEY.value]
        out.append(f"{size} requests ({block['n_tenants']} tenants of {block['n_batches']} batches): a tenant's bill is within "
                   f"{_pct_ci(err, 'p90')} of its measured Shapley value (p90; median {_pct_ci(err, 'p50')}), median 95% "
                   f"half-width {_pct_ci(block['halfwidth_over_share'], 'p50')} of its share, "
                   f"{_pct(block['bill_within_interval_fraction'])} of bills inside the measured value's interval")
    return out

