"""The regression Shapley estimator judged on a validation journal: coverage where the truth is known, precision
against permutation sampling at serving size, and whether the measured games are additive.

Three checks, all from the measurements already journaled (no engine):

- **Exact batches** (every subset measured K times): measuring only m coalitions is simulated by subsampling the
  measured subsets (the full batch and m − 1 others in complementary pairs, so each request is in about half of
  them), one repeat each; the regression's 95% interval is checked against the exact Shapley value of the *other*
  repeats (their mean), so the two are independent and the interval of the difference carries both variances
  (the exact value's from the batch's pure error). Coverage against the exact value the analysis ships (median of
  all repeats) is reported too, with the estimator's interval alone.
- **Serving-size batches** (the prefixes of sampled orders measured once each): the regression from exactly those
  measured steps against the permutation estimate the analysis reports (`llmvisor.validation.analysis`), half-width
  by half-width.
- **Additivity**: a lack-of-fit F-test per batch (`llmvisor.validation.game.additivity_test`): exact batches against
  their own pure error; serving-size batches, which have no repeats, against the relative noise floor of the exact
  batches of the same phase.

The regression is fitted several ways (`VARIANTS`; the headline is `HEADLINE_VARIANT`), and KernelSHAP (unbiased,
paired) is judged on the exact batches beside it. A simulation (`simulate_precision`) shows what the measurement
design costs: the prefixes of orders are nested coalitions, on which a regression gains little over permutation
sampling; random complementary coalitions at the same number of steps gain about √(n/2).
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from llmvisor import shipped
from llmvisor.core.game import SubsetGame
from llmvisor.core.model import StepLatencyModel
from llmvisor.validation.analysis import analyse_batch, analyse_sampled_batch, plain_quantiles, record_group
from llmvisor.validation.game import (
    additivity_test,
    coalition_indicators,
    exact_shapley,
    kernel_shap,
    prefix_masks,
    regression_shapley,
    sample_kernel_pairs,
    sample_orders,
)
from llmvisor.validation.measurement import Journal
from llmvisor.validation.plans import (
    BatchSpec,
    Envelope,
    SampledBatchSpec,
    draw_batches,
    read_length_mixes,
    sampled_plan,
)

FIGURES_FORMAT = "llmvisor.validation.estimator"
EXACT_MIN_SIZE = 4
"""Exact batches this large or larger are subsampled (a batch of 3 has only 3 complementary pairs of subsets)."""
COALITION_COUNTS = {"2n+1": lambda n: 2 * n + 1, "2n+5": lambda n: 2 * n + 5, "all": lambda n: (1 << n) - 1}
"""Measured coalitions m per subsampled exact batch of n requests: the full batch and (m − 1) / 2 complementary pairs
(n − 1 pairs at least: a pair adds one direction beyond the intercept, so fewer leave the fit without residual)."""
SAMPLED_PHASE_FLOOR = {"sampled_decode": "decode", "sampled_shared_prefix_decode": "decode", "sampled_prefill": "prefill",
                       "sampled_mixed": "prefill"}
"""Whose exact batches' relative noise floor a serving-size kind is tested against (a mixed step is dominated by its
prefill chunk)."""


@dataclass
class Validation:
    """A measured validation: its plan (redrawn from the result's settings), journal, latency model and settings."""

    batches: list[BatchSpec]
    sampled_batches: list[SampledBatchSpec]
    journal: Journal
    model: StepLatencyModel
    settings: dict


def load_validation(result_path: str | Path | None = None, journal_path: str | Path | None = None,
                    model_path: str | Path | None = None) -> Validation:
    """The plan a result was measured with (drawn again from its settings, as ``validate -o RESULT`` does) and its
    journal (gzipped or not; default: the shipped result and journal)."""
    result_path = Path(result_path) if result_path else shipped.result_path(shipped.VALIDATION_RESULT)
    settings = json.loads(result_path.read_text(encoding="utf-8"))["settings"]
    journal_path = Path(journal_path) if journal_path else result_path.with_name(shipped.VALIDATION_JOURNAL)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "journal.jsonl"
        opener = gzip.open if journal_path.suffix == ".gz" else open
        with opener(journal_path, "rb") as source, open(plain, "wb") as target:
            shutil.copyfileobj(source, target)
        journal = Journal(plain)
    model = StepLatencyModel.from_json(model_path or shipped.latency_model_path())
    mixes = read_length_mixes()
    envelope = Envelope(settings["max_model_len"], settings["max_num_batched_tokens"], settings["max_num_seqs"])
    batches, _ = draw_batches(mixes, envelope, n_batches=settings["batches"], max_batch=settings["max_batch"],
                              adversarial_fraction=settings["adversarial_fraction"], replicate_every=settings["replicate_every"],
                              max_prefill_tokens=settings["max_prefill_tokens"], seed=settings["seed"]) if settings["batches"] else ([], {})
    sampled = []
    if settings.get("sampled"):
        sampled = sampled_plan(mixes, envelope, settings["sampled"], seed=settings["seed"])
    return Validation(batches, sampled, journal, model, settings)


def shapley_matrix(n: int) -> np.ndarray:
    """``W`` with φ = W · cost[1:] (the exact Shapley value is linear in the non-empty subsets' costs)."""
    eye = np.eye((1 << n) - 1)
    return np.column_stack([exact_shapley(np.concatenate([[0.0], col])) for col in eye.T])


def prefix_coalitions(n: int, m: int, rng: np.random.Generator) -> list[int]:
    """The full batch and the distinct prefixes of random antithetic order pairs (an order and its reverse), pairs added
    until at least ``m`` coalitions (the permutation design's steps, as `validate --design prefixes` measures them),
    redrawn until they tell every request apart."""
    full = (1 << n) - 1
    for _ in range(100):
        masks = {full}
        while len(masks) < min(m, full):
            masks.update(int(x) for x in prefix_masks(sample_orders(n, 2, rng)).ravel())
        chosen = [full] + sorted(masks - {full})
        x = np.column_stack([np.ones(len(chosen)), coalition_indicators(chosen, n)])
        if np.linalg.matrix_rank(x.T @ x) == n + 1:
            return chosen
    raise ValueError(f"no {m} order prefixes of {n} requests tell them apart")


def complementary_coalitions(n: int, m: int, rng: np.random.Generator) -> list[int]:
    """The full batch and (m − 1) / 2 distinct complementary pairs (S, B∖S) of proper subsets, S drawn with each request
    in it with probability ½, so that each request is in exactly half of the pairs' coalitions; redrawn until they
    tell every request apart (n − 1 pairs at least)."""
    full = (1 << n) - 1
    k = (m - 1) // 2
    if k > (1 << (n - 1)) - 1:
        raise ValueError(f"{n} requests have only {(1 << (n - 1)) - 1} complementary pairs (asked for {k})")
    for _ in range(100):
        pairs: set[int] = set()
        while len(pairs) < k:
            s = (int(rng.integers(0, 1 << 32)) | int(rng.integers(0, 1 << 32)) << 32) & full
            if 0 < s < full:
                pairs.add(min(s, full ^ s))
        masks = [full] + [c for p in sorted(pairs) for c in (p, full ^ p)]
        x = np.column_stack([np.ones(len(masks)), coalition_indicators(masks, n)])
        if np.linalg.matrix_rank(x.T @ x) == n + 1:
            return masks
    raise ValueError(f"no {m} complementary coalitions of {n} requests tell them apart")


COVERAGE_DESIGNS = {"coalitions": complementary_coalitions, "prefixes": prefix_coalitions}
"""How `exact_coverage` draws the m measured coalitions: random complementary pairs (the coalitions design) or the
prefixes of random antithetic orders (the steps the permutation design measures)."""


def pure_error_var(groups: list[np.ndarray]) -> tuple[float, int]:
    """Pooled within-group variance of repeated measurements and its degrees of freedom."""
    ss = sum(float(np.sum((g - g.mean()) ** 2)) for g in groups if g.size > 1)
    dof = sum(g.size - 1 for g in groups if g.size > 1)
    return (ss / dof if dof else math.nan), dof


def exact_batch_games(v: Validation, repeat: int) -> list[dict]:
    """Each exactly measured batch's repeats per subset (round 0; ``times[s − 1]``: subset s's ``repeat`` times), its
    record from the analysis (shipped exact Shapley value: of the medians) and its pure error."""
    out = []
    for batch in v.batches:
        record = analyse_batch(batch, v.journal, v.model, repeat)
        if record is None:
            continue
        times = np.array([[m.step_latency_s for m in v.journal.get(batch, 0, s)[:repeat]] for s in range(1, 1 << batch.size)])
        sigma2, dof = pure_error_var(list(times))
        rel2, rel_dof = pure_error_var(list(times / times.mean(axis=1, keepdims=True)))
        out.append({"batch": batch, "record": record, "times": times, "pure_error_var": sigma2, "pure_error_dof": dof,
                    "relative_pure_error_var": rel2})
    return out


def exact_coverage(games: list[dict], *, coalition_counts=COALITION_COUNTS, trials: int = 20, min_size: int = EXACT_MIN_SIZE,
                   confidence: float = 0.95, seed: int = 0, variant: str = "plain", design: str = "coalitions") -> dict:
    """Coverage of the regression's intervals on exact batches, measuring only m coalitions (see the module's notes);
    ``variant`` as in `fit_variant` (the control variate is not offered here: it needs the model game of each subset,
    which the exact batches' records carry, but it changes nothing where that game is additive), or "kernel_shap"
    (`llmvisor.validation.game.kernel_shap` on kernel-drawn pairs: its spread over pairs holds the measurement noise
    of the coalitions drawn, so the same combined interval is used). ``design``: how the m coalitions are drawn
    (`COVERAGE_DESIGNS`)."""
    rng = np.random.default_rng([seed, 21])
    draw = COVERAGE_DESIGNS[design]
    rows = {label: {"independent": [], "estimator_only": [], "vs_shipped": [], "half_width_fraction_of_step": [], "error_fraction_of_step": []}
            for label in coalition_counts}
    chosen = [g for g in games if g["batch"].size >= min_size]
    for g in chosen:
        n, times = g["batch"].size, g["times"]
        k = times.shape[1]
        w_matrix = shapley_matrix(n)
        shipped_phi = np.asarray(g["record"]["shapley_s"])
        step_s = g["record"]["measured_step_s"]
        truth_var = g["pure_error_var"] / (k - 1) * np.sum(w_matrix**2, axis=1)
        for label, count in coalition_counts.items():
            m = min(count(n), (1 << n) - 1)
            for _ in range(trials):
                r = int(rng.integers(k))
                others = np.delete(times, r, axis=1).mean(axis=1)
                truth = w_matrix @ others
                if variant == "kernel_shap":
                    # the full batch plus (m − 1) / 2 kernel-drawn pairs: the same m measured steps
                    masks = sample_kernel_pairs(n, (m - 1) // 2, rng)
                    est = kernel_shap(masks, times[np.array(masks) - 1, r], n, full_cost_s=float(times[-1, r]), confidence=confidence)
                    quantile_dof = est["n_pairs"] - 1
                else:
                    masks = draw(n, m, rng)
                    est = fit_variant(variant, masks, times[np.array(masks) - 1, r], n, confidence=confidence)
                    quantile_dof = est["residual_dof"]
                quantile = float(stats.t.ppf(0.5 + confidence / 2, quantile_dof))
                diff = est["shapley_s"] - truth
                rows[label]["independent"].extend(np.abs(diff) <= quantile * np.sqrt(est["std_err_s"] ** 2 + truth_var))
                rows[label]["estimator_only"].extend((est["ci_low_s"] <= truth) & (truth <= est["ci_high_s"]))
                rows[label]["vs_shipped"].extend((est["ci_low_s"] <= shipped_phi) & (shipped_phi <= est["ci_high_s"]))
                rows[label]["half_width_fraction_of_step"].extend((est["ci_high_s"] - est["ci_low_s"]) / 2 / step_s)
                rows[label]["error_fraction_of_step"].extend(np.abs(diff) / step_s)
    by_m = {}
    for label, row in rows.items():
        if not row["independent"]:
            continue
        by_m[label] = {
            "n_estimates": len(row["independent"]),
            "coverage_95": float(np.mean(row["independent"])),
            "coverage_95_estimator_interval_only": float(np.mean(row["estimator_only"])),
            "coverage_95_of_shipped_exact_value": float(np.mean(row["vs_shipped"])),
            "half_width_fraction_of_step": plain_quantiles(row["half_width_fraction_of_step"], qs=(50, 90)),
            "abs_error_fraction_of_step": plain_quantiles(row["error_fraction_of_step"], qs=(50, 90)),
        }
    pooled = [c for row in rows.values() for c in row["independent"]]
    return {
        "n_batches": len(chosen),
        "sizes": sorted({g["batch"].size for g in chosen}),
        "trials_per_batch": trials,
        "coverage_95": float(np.mean(pooled)) if pooled else None,
        "coverage_95_min_over_m": min((b["coverage_95"] for b in by_m.values()), default=None),
        "by_coalitions": by_m,
        "how": "per trial: one repeat r of every subset is the measurement, the mean of the other repeats the exact game; "
        "m coalitions (the full batch + complementary pairs) estimated by regression; covered when |estimate − exact| ≤ "
        "t·√(se² + var(exact)), var(exact) from the batch's pure error (independent repeats: no shared noise)",
    }


VARIANTS = ("plain", "relative_weights", "relative_weights_rounds", "control")
"""How the regression is fitted: ordinary least squares; weighted by 1 / T̂(S)² (noise proportional to the step
time, T̂ the ordinary additive fit); the same with an offset per batch-round (a serving-size batch measures one
order per batch-round; an exact batch has one round, where it is the same as ``relative_weights``); or ordinary with
the latency model's game as control variate."""


def fit_variant(variant: str, masks: list[int], cost_s: np.ndarray, n: int, *, control=None, control_shapley=None,
                blocks=None, confidence: float = 0.95) -> dict:
    """`regression_shapley` fitted as ``variant`` (`VARIANTS`); ``blocks``: each measurement's batch-round."""
    if variant == "relative_weights_rounds":
        return regression_shapley(masks, cost_s, n, weights=relative_weights(masks, cost_s, n), blocks=blocks, confidence=confidence)
    if variant == "plain":
        return regression_shapley(masks, cost_s, n, confidence=confidence)
    if variant == "relative_weights":
        return regression_shapley(masks, cost_s, n, weights=relative_weights(masks, cost_s, n), confidence=confidence)
    if variant == "control":
        return regression_shapley(masks, cost_s, n, control=control, control_shapley=control_shapley, confidence=confidence)
    raise ValueError(f"unknown variant {variant!r} (choose from {', '.join(VARIANTS)})")


def sampled_costs(batch: SampledBatchSpec, journal: Journal, repeat: int) -> tuple[list[int], np.ndarray, list[int]]:
    """The measured coalitions of a serving-size batch (its order prefixes), their times (median of the repeats) and
    the order each was measured with (`llmvisor.validation.measurement.measure_sampled` measures a subset in the
    first order whose prefixes hold it, one batch-round per order)."""
    masks = batch.subsets()
    first: dict[int, int] = {}
    for k, row in enumerate(prefix_masks(np.array(batch.orders, dtype=np.int64))):
        for m in row:
            first.setdefault(int(m), k)
    times = np.array([float(np.median([m.step_latency_s for m in journal.get(batch, 0, s)[:repeat]])) for s in masks])
    return masks, times, [first[s] for s in masks]


def relative_noise_floor(games: list[dict]) -> dict:
    """Per phase, the pooled relative variance of one measurement around its subset's mean (exact batches' repeats)."""
    out = {}
    for phase in ("prefill", "decode"):
        chosen = [g for g in games if g["batch"].phase == phase]
        groups = [row / row.mean() for g in chosen for row in g["times"]]
        var, dof = pure_error_var(groups)
        out[phase] = {"relative_var": var, "relative_sd": math.sqrt(var), "dof": dof, "n_batches": len(chosen)}
    return out


def canary_floor(journal: Journal, tolerance: float = 0.25) -> dict:
    """The canaries' relative spread around their median, over those the interference guard would pass (a second
    view of the per-measurement floor: one fixed 128-token prefill step, re-timed through the whole run, so slow
    drift between batch-rounds is in it too)."""
    c = np.asarray(journal.canary_s, dtype=np.float64)
    if c.size == 0:
        return {"n": 0}
    r = c / np.median(c) - 1
    kept = r[r <= tolerance]
    return {"n": int(c.size), "n_passing": int(kept.size), "relative_sd": float(np.sqrt(np.mean(kept**2))),
            "relative_sd_mad": float(1.4826 * np.median(np.abs(kept - np.median(kept))))}


def relative_weights(masks: list[int], cost_s: np.ndarray, n: int) -> np.ndarray:
    """1 / T̂(S)², T̂ the ordinary additive fit: weights for noise proportional to the step time (feasible WLS)."""
    x = np.column_stack([np.ones(len(masks)), coalition_indicators(masks, n)])
    coef, *_ = np.linalg.lstsq(x, cost_s, rcond=None)
    fitted = np.maximum(x @ coef, 0.05 * float(np.max(cost_s)))
    return 1.0 / fitted**2


def sampled_comparison(v: Validation, games: list[dict], *, repeat: int | None = None, confidence: float = 0.95) -> dict:
    """Regression vs permutation estimates on the serving-size batches, from the same measured steps; additivity tests."""
    repeat = repeat or v.settings.get("sampled", {}).get("repeat", 1)
    floor = relative_noise_floor(games)
    per_batch = []
    for batch in v.sampled_batches:
        record = analyse_sampled_batch(batch, v.journal, v.model, repeat)
        if record is None:
            continue
        n = batch.size
        masks, cost, rounds = sampled_costs(batch, v.journal, repeat)
        control = SubsetGame(v.model, np.array(record["num_new_tokens"], dtype=np.float64), np.array(record["num_context_tokens"]),
                            np.array(record["is_prefill"], dtype=bool), np.array(record["num_shared_context_tokens"]))
        control_phi = np.asarray(record["shares_s"]["shapley_predicted"])
        variants = {k: fit_variant(k, masks, cost, n, control=control, control_shapley=control_phi, blocks=rounds, confidence=confidence)
                    for k in VARIANTS}
        group = record_group(record)
        phase_floor = floor[SAMPLED_PHASE_FLOOR[group]]
        test = additivity_test(masks, cost, n, weights=relative_weights(masks, cost, n), noise_var=phase_floor["relative_var"],
                               noise_dof=phase_floor["dof"])
        low, high = (np.array([np.nan if x is None else x for x in side]) for side in record["shapley_ci95_s"])
        perm_se = (high - low) / 2 / float(stats.t.ppf(0.5 + confidence / 2, max(record["n_orders"] // (2 if batch.antithetic else 1) - 1, 1)))
        per_batch.append({
            "permutation_std_err_s": perm_se,
            "std_err_s": {k: e["std_err_s"] for k, e in variants.items()},
            "sigma2_plain": variants["plain"]["sigma2"],
            "index": batch.index, "kind": group, "size": n, "n_steps": len(masks),
            "measured_step_s": record["measured_step_s"],
            "share_s": np.asarray(record["shares_s"]["shapley"]),
            "permutation_half_s": (high - low) / 2,
            "permutation_shapley_s": np.asarray(record["shapley_s"]),
            "half_s": {k: (e["ci_high_s"] - e["ci_low_s"]) / 2 for k, e in variants.items()},
            "shapley_s": {k: e["shapley_s"] for k, e in variants.items()},
            "additivity": test,
        })
    return {"per_batch": per_batch, "noise_floor": floor}


def halfwidth_summary(per_batch: list[dict], variant: str) -> dict:
    """Half-width ratios (permutation ÷ regression) per batch size and per kind, and half-widths ÷ shares per kind."""
    def ratio(chosen):
        perm = np.concatenate([b["permutation_half_s"] / b["measured_step_s"] for b in chosen])
        reg = np.concatenate([b["half_s"][variant] / b["measured_step_s"] for b in chosen])
        ok = np.isfinite(perm) & (reg > 0)
        paired = perm[ok] / reg[ok]
        return {
            "median_ratio_of_halfwidths": float(np.median(paired)),
            "ratio_p10_p90": np.percentile(paired, [10, 90]).tolist(),
            "ratio_of_median_halfwidths_fraction_of_step": float(np.median(perm[ok]) / np.median(reg[ok])),
            "n_requests": int(ok.sum()),
            "n_batches": len(chosen),
        }

    sizes = sorted({b["size"] for b in per_batch})
    kinds = sorted({b["kind"] for b in per_batch})
    over_share = {}
    over_share_perm = {}
    for kind in kinds:
        chosen = [b for b in per_batch if b["kind"] == kind]
        share = np.concatenate([b["share_s"] for b in chosen])
        over_share[kind] = float(np.median(np.concatenate([b["half_s"][variant] for b in chosen]) / share))
        perm = np.concatenate([b["permutation_half_s"] for b in chosen]) / share
        over_share_perm[kind] = float(np.median(perm[np.isfinite(perm)]))
    z = np.concatenate([np.abs(b["shapley_s"][variant] - b["permutation_shapley_s"])
                        / np.sqrt(b["permutation_std_err_s"] ** 2 + b["std_err_s"][variant] ** 2) for b in per_batch])
    z = z[np.isfinite(z)]
    return {
        "agreement_with_permutation": {
            "fraction_z_over_1_96": float(np.mean(z > 1.96)),
            "median_z": float(np.median(z)),
            "n_requests": int(z.size),
            "note": "|regression − permutation| / √(se² + se²) per request; both estimates use the same steps, so this is "
            "a consistency check (a large fraction would show one of them biased or its interval too narrow), not a coverage",
        },
        "by_size": {str(s): ratio([b for b in per_batch if b["size"] == s]) for s in sizes},
        "by_size_and_kind": {f"{s}/{k}": ratio(c) for s in sizes for k in kinds if (c := [b for b in per_batch if b["size"] == s and b["kind"] == k])},
        "halfwidth_over_share_p50": over_share,
        "permutation_halfwidth_over_share_p50": over_share_perm,
    }


def additivity_summary(exact_tests: list[tuple[dict, dict]], sampled: list[dict]) -> dict:
    """Fraction of batches whose additive fit is rejected at 5%, per kind, and the interaction size ÷ the step."""
    out = {}
    rows = [(f"{g['batch'].phase}/{g['batch'].kind}", t, g["record"]["measured_step_s"], False) for g, t in exact_tests]
    rows += [(b["kind"], b["additivity"], 1.0, True) for b in sampled]
    for kind in sorted({k for k, *_ in rows}):
        chosen = [(t, step, relative) for k, t, step, relative in rows if k == kind and t["rejected"] is not None]
        if not chosen:
            continue
        out[kind] = {
            "n_batches": len(chosen),
            "rejected_fraction_5pct": float(np.mean([t["rejected"] for t, *_ in chosen])),
            "noise_source": chosen[0][0]["noise_source"],
            # relative weights: the interaction is already a fraction of each coalition's time
            "interaction_rms_fraction_of_step": plain_quantiles(
                (t["interaction_rms"] if relative else t["interaction_rms"] / step) for t, step, relative in chosen),
            "misfit_over_noise": plain_quantiles(t["f"] for t, *_ in chosen),
        }
    return out


SIMULATED_SIZES = (8, 16, 32, 64)


def simulate_precision(sizes=SIMULATED_SIZES, *, n_orders: int = 8, reps: int = 30, noise_fraction: float = 0.02,
                       confidence: float = 0.95, seed: int = 0) -> dict:
    """The estimators on an additive game with known Shapley values and Gaussian noise per measured step.

    Per batch size n: a game b + Σ f_i (b half the step, f_i uniform), noise σ = ``noise_fraction`` × the full
    step. Measured steps: the distinct prefixes of ``n_orders`` antithetic orders (as the serving-size validation
    measures), each once. On those: the permutation estimate with the *noise-free* game as control variate (a
    perfect latency model: only the noise is left) and the regression; and the regression on as many random
    complementary coalitions. Reported: interval coverage and the precision ratios (RMS error of the permutation
    estimate ÷ the regression's), beside √(n/2).
    """
    from llmvisor.validation.game import sample_orders, sampled_shapley, subsets_to_measure

    rng = np.random.default_rng([seed, 64])
    out = {}
    for n in sizes:
        rows = {"permutation": [], "prefix_regression": [], "pair_regression": []}
        covered = {k: [] for k in rows}
        half = {k: [] for k in rows}
        for _ in range(reps):
            f = rng.uniform(0.2, 1.0, n)
            f *= 0.5 / f.sum()
            b = 0.5
            phi = f + b / n
            sigma = noise_fraction * (b + f.sum())

            def value(mask: int, b=b, f=f, n=n) -> float:
                return b + sum(f[i] for i in range(n) if mask >> i & 1)

            orders = sample_orders(n, n_orders, rng)
            prefixes = subsets_to_measure(orders)
            measured = {mask: value(mask) + sigma * rng.standard_normal() for mask in prefixes}
            truth_game = {mask: value(mask) for mask in prefixes}
            truth_game[0] = measured[0] = 0.0
            perm = sampled_shapley(orders, measured, control=truth_game, control_shapley=phi, confidence=confidence)
            pairs = complementary_coalitions(n, len(prefixes) if len(prefixes) % 2 else len(prefixes) - 1, rng)
            estimates = {
                "permutation": (perm["shapley_s"], perm["ci_low_s"], perm["ci_high_s"]),
                "prefix_regression": regression_shapley(prefixes, [measured[m] for m in prefixes], n, confidence=confidence),
                "pair_regression": regression_shapley(pairs, [value(m) + sigma * rng.standard_normal() for m in pairs], n,
                                                      confidence=confidence),
            }
            for k, e in estimates.items():
                est, low, high = e if isinstance(e, tuple) else (e["shapley_s"], e["ci_low_s"], e["ci_high_s"])
                rows[k].extend((est - phi) / sigma)
                covered[k].extend((low <= phi) & (phi <= high))
                half[k].extend((high - low) / 2 / sigma)
        rms = {k: float(np.sqrt(np.mean(np.square(v)))) for k, v in rows.items()}
        out[str(n)] = {
            "measured_steps": len(prefixes),
            "coverage_95": {k: float(np.mean(v)) for k, v in covered.items()},
            "rms_error_over_sigma": rms,
            "precision_ratio_vs_permutation": {k: rms["permutation"] / rms[k] for k in ("prefix_regression", "pair_regression")},
            "halfwidth_ratio_vs_permutation": {k: float(np.median(half["permutation"]) / np.median(half[k]))
                                               for k in ("prefix_regression", "pair_regression")},
            "sqrt_n_over_2": math.sqrt(n / 2),
            "n_estimates": len(rows["permutation"]),
        }
    return {"reps": reps, "n_orders": n_orders, "noise_fraction_of_step": noise_fraction, "by_size": out}


def projected_pair_design(v: Validation, per_batch: list[dict], *, target: float = 0.25, seed: int = 0,
                          confidence: float = 0.95) -> dict:
    """What the same number of steps would give as random complementary coalitions instead of order prefixes: a plan,
    not a measurement. Per serving-size batch, the ordinary fit's residual variance on its prefixes (equal weights,
    no round offsets) times the pair design's own (XᵀX-based) variance per request gives a half-width; per kind, the
    median half-width ÷ the request's share, and the steps a batch would need for that median to reach ``target``
    (half-widths shrink as 1/√steps); per batch size and kind. Mixed batches fare worst under equal weights (their
    noise grows with the step time, which the headline fit weighs)."""
    rng = np.random.default_rng([seed, 2])
    rows: dict[str, list[float]] = {}
    steps: dict[str, list[int]] = {}
    for b in per_batch:
        n, m = b["size"], b["n_steps"] if b["n_steps"] % 2 else b["n_steps"] - 1
        masks = complementary_coalitions(n, m, rng)
        unit = regression_shapley(masks, rng.standard_normal(len(masks)), n, confidence=confidence)
        design_var = np.diag(unit["cov_s2"]) / unit["sigma2"]
        quantile = float(stats.t.ppf(0.5 + confidence / 2, unit["residual_dof"]))
        half = quantile * np.sqrt(b["sigma2_plain"] * design_var)
        rows.setdefault(f"{n}/{b['kind']}", []).extend(half / b["share_s"])
        steps.setdefault(f"{n}/{b['kind']}", []).append(m)
    out = {}
    for kind, ratios in rows.items():
        median = float(np.median(ratios))
        out[kind] = {"halfwidth_over_share_p50": median, "steps_per_batch_p50": float(np.median(steps[kind])),
                     "steps_for_target": int(math.ceil(float(np.median(steps[kind])) * (median / target) ** 2))}
    return {"target_halfwidth_over_share": target, "by_size_and_kind": dict(sorted(out.items(), key=lambda kv: (int(kv[0].split("/")[0]), kv[0]))),
            "note": "projection from the prefixes' residual variance (equal weights, no round offsets), not a measurement"}


HEADLINE_VARIANT = "relative_weights_rounds"
"""The exact batches' repeats show the noise growing with the step time (a prefill step of 10–20 ms: 8.8% RMS; over
200 ms: 2.6%), and a serving-size mixed step joins decode-only coalitions of ~30 ms with chunked ones of ~1 s: weights
1 / T̂² say so. A serving-size batch is measured one order per batch-round, and the rounds' mean residuals differ
(the machine drifts between them): an offset per round keeps that out of the values and the noise. Its intervals
cover on the exact batches (one round each: there it is ``relative_weights``); ``variants`` has the others."""


def estimator_figures(v: Validation | None = None, *, trials: int = 10, seed: int = 0, variant: str = HEADLINE_VARIANT,
                      simulation_reps: int = 20) -> dict:
    """Every figure of the estimator's evaluation on a validation (default: the shipped one), JSON-ready."""
    v = v or load_validation()
    repeat = int(v.settings["repeat"])
    games = exact_batch_games(v, repeat)
    coverage = exact_coverage(games, trials=trials, seed=seed, variant=variant)
    exact_tests = [(g, additivity_test(np.repeat(np.arange(1, 1 << g["batch"].size), g["times"].shape[1]), g["times"].ravel(),
                                       g["batch"].size)) for g in games if g["batch"].size >= 3]
    sampled = sampled_comparison(v, games)
    halfwidths = halfwidth_summary(sampled["per_batch"], variant)
    variants = {}
    for k in VARIANTS:
        summary = halfwidth_summary(sampled["per_batch"], k)
        variants[k] = {
            "exact_coverage_95": coverage["coverage_95"] if k == variant else
            (exact_coverage(games, trials=trials, seed=seed, variant=k)["coverage_95"] if k in ("plain", "relative_weights") else None),
            "halfwidth_ratio_vs_permutation": {s: r["median_ratio_of_halfwidths"] for s, r in summary["by_size"].items()},
            "halfwidth_over_share_p50": summary["halfwidth_over_share_p50"],
        }
    additivity = additivity_summary(exact_tests, sampled["per_batch"])
    per_batch = [
        {
            "index": b["index"], "kind": b["kind"], "size": b["size"], "n_steps": b["n_steps"],
            "halfwidth_ratio_median": float(np.nanmedian(b["permutation_half_s"] / b["half_s"][variant])),
            "additivity_p_value": b["additivity"]["p_value"], "additivity_rejected": b["additivity"]["rejected"],
            "interaction_rms_fraction": b["additivity"]["interaction_rms"],
        }
        for b in sampled["per_batch"]
    ]
    kernel = exact_coverage(games, trials=trials, seed=seed, variant="kernel_shap")
    variants["kernel_shap"] = {
        "exact_coverage_95": kernel["coverage_95"],
        "exact_by_coalitions": {k: {"coverage_95": r["coverage_95"], "half_width_fraction_of_step_p50": r["half_width_fraction_of_step"]["p50"]}
                                for k, r in kernel["by_coalitions"].items()},
        "note": "needs coalitions drawn from the Shapley kernel: not applicable to the journal's order prefixes",
    }
    return {
        "format": FIGURES_FORMAT,
        "seed": seed,
        "settings": {"estimator": "regression_shapley", "variant": variant, "confidence": 0.95, "coalition_counts": list(COALITION_COUNTS),
                     "exact_min_size": EXACT_MIN_SIZE, "trials_per_batch": trials},
        "summary": {
            "estimator": {
                "exact_coverage_95": coverage["coverage_95"],
                "halfwidth_ratio_vs_permutation": {s: r["median_ratio_of_halfwidths"] for s, r in halfwidths["by_size"].items()},
                "exact": coverage,
                "sampled": halfwidths,
                "variants": variants,
                "simulation": simulate_precision(reps=simulation_reps, seed=seed),
            },
            "sampled": {"halfwidth_over_share_p50": halfwidths["halfwidth_over_share_p50"], "estimator_variant": variant,
                        "projected_complementary_design": projected_pair_design(v, sampled["per_batch"], seed=seed),
                        "permutation_halfwidth_over_share_p50": halfwidths["permutation_halfwidth_over_share_p50"]},
            "additivity": additivity,
            "noise_floor": {**sampled["noise_floor"], "canary": canary_floor(v.journal)},
        },
        "sampled_batches": per_batch,
        "exact_batches": [
            {"index": g["batch"].index, "phase": g["batch"].phase, "kind": g["batch"].kind, "size": g["batch"].size,
             "additivity_p_value": t["p_value"], "additivity_rejected": t["rejected"],
             "interaction_rms_fraction": t["interaction_rms"] / g["record"]["measured_step_s"]}
            for g, t in exact_tests
        ],
    }


KIND_LABELS = {
    "sampled_decode": "decode",
    "sampled_shared_prefix_decode": "shared-prefix decode",
    "sampled_prefill": "prefill",
    "sampled_mixed": "mixed",
}


def markdown_summary(figures: dict) -> str:
    """The docs/validation.md tables of the estimator's figures (`docs/results/estimator.json`), so the doc quotes
    the file and nothing else (tests/test_estimator_doc.py)."""
    summary = figures["summary"]
    estimator, sampled = summary["estimator"], summary["sampled"]
    exact = estimator["exact"]
    lines = [
        f"Exact batches ({exact['n_batches']} batches of {'–'.join(str(s) for s in exact['sizes'])} requests, every subset measured): "
        f"the regression's 95% intervals cover the exact value of the other repeats for {pct(estimator['exact_coverage_95'])} of "
        "requests (the exact value's own noise included).",
        "",
        "| coalitions measured | coverage | interval alone | half-width ÷ step (p50) |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in exact["by_coalitions"].items():
        lines.append(f"| {name} | {pct(row['coverage_95'])} | {pct(row['coverage_95_estimator_interval_only'])} | "
                     f"{pct(row['half_width_fraction_of_step']['p50'])} |")
    ratios = estimator["halfwidth_ratio_vs_permutation"]
    lines += [
        "",
        "Serving-size batches, from the same measured prefix steps: permutation half-width ÷ regression half-width "
        "(median per request) " + ", ".join(f"{ratio:.2f}× at {size} requests" for size, ratio in ratios.items())
        + "; a request's 95% half-width as a fraction of its `shapley` share (median):",
        "",
        "| batch kind | regression | permutation | same steps as complementary pairs (projected) |",
        "| --- | --- | --- | --- |",
    ]
    projected = sampled["projected_complementary_design"]["by_size_and_kind"]
    for kind, label in KIND_LABELS.items():
        if kind not in sampled["halfwidth_over_share_p50"]:
            continue
        guesses = ", ".join(f"{pct(projected[key]['halfwidth_over_share_p50'])} ({key.split('/')[0]})"
                            for key in sorted(projected, key=lambda k: int(k.split("/")[0])) if key.endswith("/" + kind))
        lines.append(f"| {label} | {pct(sampled['halfwidth_over_share_p50'][kind])} | "
                     f"{pct(sampled['permutation_halfwidth_over_share_p50'][kind])} | {guesses} |")
    simulation = estimator["simulation"]
    lines += [
        "",
        f"Simulated additive game ({pct(simulation['noise_fraction_of_step'])} per-step noise, the steps of "
        f"{simulation['n_orders']} orders): precision (RMS error) relative to permutation sampling at equal measured steps.",
        "",
        "| requests | prefixes of orders | complementary pairs | √(n/2) | pair coverage |",
        "| --- | --- | --- | --- | --- |",
    ]
    for size, row in simulation["by_size"].items():
        ratio = row["precision_ratio_vs_permutation"]
        lines.append(f"| {size} | {ratio['prefix_regression']:.2f}× | {ratio['pair_regression']:.2f}× | "
                     f"{row['sqrt_n_over_2']:.2f} | {pct(row['coverage_95']['pair_regression'])} |")
    return "\n".join(lines)


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"
