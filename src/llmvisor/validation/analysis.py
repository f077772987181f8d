"""Judging attribution rules by the measured games: per-batch truth and shares, error quantiles, the result.

For each fully measured batch: the **exact Shapley value** φ_i of the measured game (the only efficient,
symmetric, additive split of T(B), and the measured counterpart of what the ``shapley`` rule computes from
the model) and the **leave-one-out** marginal cost T(B) − T(B∖i), whose sum misses T(B) by the shared cost.
Every request's share under each method (`Method`) is compared with φ_i (and LOO_i); errors are fractions
of the measured step time T(B). Quantiles come with batch-clustered bootstrap intervals (requests of one
batch share its measurements, so batches, not requests, are resampled).

The **noise floor**: some batches are measured twice, independently; the one floor
(`llmvisor.core.stats.replicate_noise_floor`, for a pair |φ⁽¹⁾ − φ⁽²⁾| / (√2·T(B))) estimates how far one measured
Shapley value is from the true one, the error a perfect predictor would still show; batches are resampled whole.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from enum import StrEnum

import numpy as np

from llmvisor.core.attribution import RULES, attribute_arrays
from llmvisor.core.game import VTC_TOKEN_PRICES, SubsetGame, shared_prefix_effective_context, subset_costs_s
from llmvisor.core.stats import bootstrap_interval, bootstrap_quantile_ci, quantile_summary, replicate_noise_floor
from llmvisor.validation.game import (
    additive_design,
    additive_fit,
    exact_shapley,
    leave_one_out,
    members,
    sample_orders,
    sampled_shapley,
    subset_masks,
)
from llmvisor.validation.measurement import InterferenceGuard, Journal, guard_rule
from llmvisor.validation.plans import PHASES, SAMPLED_KINDS, BatchSpec, Phase, SampledBatchSpec

RESULT_FORMAT = "llmvisor.validation"
RESULT_FORMAT_VERSION = 2
"""2: ``token_proportional`` renamed ``token_count`` (VTC's prices); per-request relative errors, class biases and
batch sizes in the summary. Version-1 files are read through `upgrade_result`."""


class Method(StrEnum):
    """A way of splitting a step's time among its requests, as named in the result's ``shares_s``."""

    SHAPLEY = "shapley"
    SHAPLEY_PREDICTED = "shapley_predicted"
    PROPORTIONAL = "proportional"
    PROPORTIONAL_PREDICTED = "proportional_predicted"
    PAPER = "paper"
    MODEL_EXACT_SHAPLEY = "model_exact_shapley"
    TOKEN_COUNT = "token_count"
    EQUAL_SPLIT = "equal_split"
    KV_TOKENS_PROPORTIONAL = "kv_tokens_proportional"
    MEASURED_ADDITIVE_FIT = "measured_additive_fit"


HEADLINE_METHOD = Method.SHAPLEY
BASELINE_METHOD = Method.TOKEN_COUNT
GOAL = {"median_max": 0.05, "p90_max": 0.10, "p90_improvement_vs_token_count_min": 2.0}
LEGACY_NAMES = {"token_proportional": Method.TOKEN_COUNT.value}
"""Names of version-1 results and what they are called now."""
RELATIVE_ERROR_FLOOR = 0.02
"""Per-request relative errors are taken over requests whose measured Shapley value is at least this fraction of
the step: below it the denominator is within the noise floor of re-measuring (p90 ~2–3% of the step)."""


def quantiles_with_ci(
    errors: np.ndarray, groups: np.ndarray, *, qs=(50, 90, 99), n_bootstrap: int = 1000, seed: int = 0
) -> dict:
    """Quantiles of ``errors`` and their bootstrap 95% intervals, resampling whole groups (batches):
    `llmvisor.core.stats.bootstrap_quantile_ci` with ``resample="groups"``. No resamples: the point as interval."""
    errors = np.asarray(errors, dtype=np.float64)
    out: dict = {"n": int(errors.size)}
    if errors.size == 0:
        for q in qs:
            out[f"p{q}"] = None
            out[f"p{q}_ci95"] = None
        return out
    point = quantile_summary(errors, qs)
    ci = bootstrap_quantile_ci(errors, tuple(qs), groups=groups, resample="groups", n_resamples=n_bootstrap, seed=seed)["ci"]
    for q in qs:
        out[f"p{q}"] = point[f"p{q}"]
        out[f"p{q}_ci95"] = ci.get(q, [point[f"p{q}"], point[f"p{q}"]])
    out["mean"] = float(errors.mean())
    return out


def model_shares(model, new: np.ndarray, context: np.ndarray, is_prefill: np.ndarray, measured_s: float,
                 effective_context: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Every rule's shares of one step; ``effective_context`` (shared KV, trace format v2) defaults to the context."""
    offsets = np.array([0, new.size])
    shares = {}
    for rule in RULES:
        scaled = attribute_arrays(model, new, context, is_prefill, offsets, np.array([measured_s]), rule, effective_context)
        shares[rule] = scaled.share_s
        if rule != Method.PAPER:
            shares[f"{rule}_predicted"] = attribute_arrays(model, new, context, is_prefill, offsets, None, rule, effective_context).share_s
    return shares


def token_count_split(new: np.ndarray, is_prefill: np.ndarray) -> np.ndarray:
    """Fractions of a step by VTC's token prices (`llmvisor.core.game.TokenPrices.step_fractions`): prefill tokens
    as prompt (×1), a decode's token as output (×2)."""
    return VTC_TOKEN_PRICES.step_fractions(new, is_prefill)


def model_subset_costs(model, new: np.ndarray, context: np.ndarray, is_prefill: np.ndarray) -> np.ndarray:
    """The model's predicted time of every subset of a batch (index = bit mask; 0 for the empty set): the
    cost game whose Shapley value the attribution rule is (``llmvisor.core.game.subset_costs_s``)."""
    return subset_costs_s(model, new, context, is_prefill)


def analyse_batch(batch: BatchSpec, journal: Journal, model, repeat: int) -> dict | None:
    """Measured game, Shapley and LOO values, and every method's shares for one fully measured batch."""
    n = batch.size
    rounds = []
    for round_ in range(batch.rounds):
        cost = np.zeros(1 << n)
        spread = []
        flagged = False
        contexts: list[list[int]] = [[] for _ in range(n)]
        for subset in range(1, 1 << n):
            taken = journal.get(batch, round_, subset)[:repeat]
            if len(taken) < repeat:
                return None
            times = np.array([m.step_latency_s for m in taken])
            flagged |= any(m.interference for m in taken)
            cost[subset] = float(np.median(times))
            if times.size >= 2:
                spread.extend(np.abs(times - cost[subset]) / cost[subset])
            for m in taken:
                for i, c in zip(members(subset, n), m.num_context_tokens):
                    contexts[i].append(c)
        rounds.append({"cost": cost, "spread": spread, "contexts": contexts, "flagged": flagged})
    first = rounds[0]
    cost = first["cost"]
    measured_s = float(cost[-1])
    phi = exact_shapley(cost)
    loo = leave_one_out(cost)
    new = np.array(batch.num_new_tokens, dtype=np.float64)
    nominal = np.array(batch.num_context_tokens, dtype=np.float64)
    context = np.array([np.mean(c) for c in first["contexts"]]) if batch.phase == Phase.DECODE else nominal
    is_prefill = np.full(n, batch.phase == Phase.PREFILL)
    shares = model_shares(model, new, np.rint(context), is_prefill, measured_s)
    model_cost = model_subset_costs(model, new, np.rint(context), is_prefill)
    model_phi = exact_shapley(model_cost)
    shares[Method.MODEL_EXACT_SHAPLEY] = model_phi * (measured_s / model_phi.sum()) if model_phi.sum() > 0 else np.full(n, measured_s / n)
    shares[Method.TOKEN_COUNT] = measured_s * token_count_split(new, is_prefill)
    shares[Method.EQUAL_SPLIT] = np.full(n, measured_s / n)
    kv = new + context
    shares[Method.KV_TOKENS_PROPORTIONAL] = measured_s * kv / kv.sum()
    fit = additive_fit(cost)
    shares[Method.MEASURED_ADDITIVE_FIT] = np.asarray(fit["shapley_s"])
    out = {
        "index": batch.index,
        "phase": batch.phase,
        "kind": batch.kind,
        "source": batch.source,
        "size": n,
        "num_new_tokens": list(batch.num_new_tokens),
        "nominal_context_tokens": list(batch.num_context_tokens),
        "num_context_tokens": context.tolist(),
        "context_drift_tokens": float(max((max(c) - min(c)) for c in first["contexts"])),
        "measured_step_s": measured_s,
        "subset_step_s": [r["cost"][1:].tolist() for r in rounds],
        "model_subset_step_s": model_cost[1:].tolist(),
        "shapley_s": phi.tolist(),
        "loo_s": loo.tolist(),
        "loo_sum_gap_fraction": float((loo.sum() - measured_s) / measured_s),
        "shares_s": {k: np.asarray(v, dtype=np.float64).tolist() for k, v in shares.items()},
        "additive_fit": fit,
        "step_spread": first["spread"],
        "interference_flagged": any(r["flagged"] for r in rounds),
    }
    if len(rounds) > 1:
        out["shapley_replicate_s"] = exact_shapley(rounds[1]["cost"]).tolist()
        out["measured_step_replicate_s"] = float(rounds[1]["cost"][-1])
    return out


INTERACTION_TERMS = {
    "max_tokens": "max over the subset of the request's length (decode: context; prefill: new tokens)",
    "size_x_max_tokens": "|S| · max length: every request padded to the longest (attention padding)",
    "pairs": "|S|·(|S| − 1)/2: a cost growing with the number of request pairs",
    "total_tokens_squared": "(Σ length)²: a cost convex in the step's total tokens",
}


def _term(name: str, lengths: np.ndarray) -> float:
    if name == "max_tokens":
        return float(lengths.max())
    if name == "size_x_max_tokens":
        return float(lengths.size * lengths.max())
    if name == "pairs":
        return lengths.size * (lengths.size - 1) / 2
    if name == "total_tokens_squared":
        return float(lengths.sum()) ** 2
    raise KeyError(name)


def interaction_diagnostics(records: list[dict]) -> dict:
    """Which non-additive cost, if any, the measured games hold beyond the additive form, per phase.

    Pooled over batches of 3 or more requests: each batch keeps its own additive game (b + Σ f_i, fixed
    effects), and one coefficient per candidate term (``INTERACTION_TERMS``) is fitted on what the additive
    games leave (Frisch–Waugh). Reported: the coefficient (seconds per unit), its standard error and t, and
    the share of the additive residual it explains; a term that explains little leaves nothing to fix.
    """
    out: dict = {}
    for phase in PHASES:
        batches = [r for r in records if r["phase"] == phase and r["size"] >= 3]
        if not batches:
            continue
        residuals, projected = [], {name: [] for name in INTERACTION_TERMS}
        for r in batches:
            n = r["size"]
            lengths = np.asarray(r["num_context_tokens"] if phase == Phase.DECODE else r["num_new_tokens"], dtype=np.float64)
            masks = subset_masks(n)[1:]
            x = additive_design(n)
            pinv = np.linalg.pinv(x)
            y = np.asarray(r["subset_step_s"][0])
            residuals.append(y - x @ (pinv @ y))
            for name in INTERACTION_TERMS:
                z = np.array([_term(name, lengths[members(int(m), n)]) for m in masks])
                projected[name].append(z - x @ (pinv @ z))
        res = np.concatenate(residuals)
        dof = res.size - sum(r["size"] + 1 for r in batches)
        terms = {}
        for name, pieces in projected.items():
            z = np.concatenate(pieces)
            zz = float(z @ z)
            if zz <= 0:
                continue
            coef = float(res @ z) / zz
            left = res - coef * z
            sigma2 = float(left @ left) / max(dof - 1, 1)
            explained = 1 - float(left @ left) / float(res @ res) if float(res @ res) > 0 else 0.0
            terms[name] = {
                "coef": coef,
                "std_err": math.sqrt(sigma2 / zz),
                "t": coef / math.sqrt(sigma2 / zz) if sigma2 > 0 else None,
                "explained_fraction_of_additive_residual": explained,
                "description": INTERACTION_TERMS[name],
            }
        out[phase] = {
            "n_batches": len(batches),
            "additive_residual_rms_s": float(np.sqrt(np.mean(res**2))),
            "additive_residual_rms_fraction": float(np.sqrt(np.mean(np.concatenate([rr / r["measured_step_s"] for rr, r in zip(residuals, batches)]) ** 2))),
            "terms": terms,
        }
    return out


def _error_table(records: list[dict], target: str, methods: list[str], n_bootstrap: int, seed: int) -> dict:
    out = {}
    for method in methods:
        errors, groups = [], []
        for r in records:
            truth = np.asarray(r[f"{target}_s"])
            share = np.asarray(r["shares_s"][method])
            errors.extend(np.abs(share - truth) / r["measured_step_s"])
            groups.extend([r["index"]] * r["size"])
        out[method] = quantiles_with_ci(np.array(errors), np.array(groups), n_bootstrap=n_bootstrap, seed=seed)
    return out


def plain_quantiles(values: Iterable[float], qs=(10, 50, 90, 99)) -> dict:
    """n, mean and quantiles (`llmvisor.core.stats.quantile_summary`); only n when there are no values."""
    return quantile_summary(values, qs, mean=True, empty="omit")


def summarize(records: list[dict], *, n_bootstrap: int = 1000, seed: int = 0, agreement_orders: int = 8) -> dict:
    """Error quantiles per phase (and per kind) for every method against measured Shapley and LOO values.

    The per-phase tables (errors, noise floor, additivity, goal) are over the exactly measured batches; sampled
    (serving-size) batches get their own tables (``sampled``) and join the billing views (per-request error,
    class bias, batch sizes) as their own groups (`record_group`). ``sampler_agreement`` re-estimates the exact
    batches' Shapley values by the sampler from their own measured subsets."""
    if not records:
        return {}
    all_records, records = records, [r for r in records if not r.get("sampled")]
    sampled = [r for r in all_records if r.get("sampled")]
    all_methods = list(dict.fromkeys(m for r in all_records for m in r["shares_s"]))
    if not records:
        return {
            "sampled": sampled_summary(sampled, n_bootstrap=n_bootstrap, seed=seed),
            "per_request_error": per_request_error(all_records, all_methods, n_bootstrap=n_bootstrap, seed=seed),
            **dict(zip(("class_bias", "class_definitions"), class_bias(all_records, all_methods, n_bootstrap=n_bootstrap, seed=seed))),
            "batch_sizes": batch_sizes(all_records),
            "errors": {},
            "methods": all_methods,
        }
    methods = list(records[0]["shares_s"])
    summary: dict = {"errors": {}, "errors_by_kind": {}, "improvement_vs_token_count": {}, "loo_sum_gap_fraction": {},
                     "noise_floor": {"step": {}, "shapley": {}}, "additivity": {}, "goal": dict(GOAL), "goal_met": {}}
    for phase in PHASES:
        phase_records = [r for r in records if r["phase"] == phase]
        if not phase_records:
            continue
        errors = {target: _error_table(phase_records, target, methods, n_bootstrap, seed) for target in ("shapley", "loo")}
        summary["errors"][phase] = errors
        summary["errors_by_kind"][phase] = {
            kind: _error_table([r for r in phase_records if r["kind"] == kind], "shapley", methods, 0, seed)
            for kind in sorted({r["kind"] for r in phase_records})
        }
        token_p90 = errors["shapley"][BASELINE_METHOD]["p90"]
        summary["improvement_vs_token_count"][phase] = {
            m: (token_p90 / v["p90"] if v["p90"] else None) for m, v in errors["shapley"].items()
        }
        summary["loo_sum_gap_fraction"][phase] = plain_quantiles(r["loo_sum_gap_fraction"] for r in phase_records)
        summary["noise_floor"]["step"][phase] = plain_quantiles(x for r in phase_records for x in r["step_spread"])
        replicated = [r for r in phase_records if "shapley_replicate_s" in r]
        floor = replicate_noise_floor(
            [pair for r in replicated for pair in zip(r["shapley_s"], r["shapley_replicate_s"])],
            [r["measured_step_s"] for r in replicated for _ in range(r["size"])],
            clusters=[r["index"] for r in replicated for _ in range(r["size"])], n_resamples=n_bootstrap, seed=seed,
        ) or {}
        summary["noise_floor"]["shapley"][phase] = {
            "n_batches": len(replicated),
            "n": floor.get("n_measurements", 0),
            **{f"p{q}": floor.get(f"p{q}") for q in (50, 90, 99)},
            **{f"p{q}_ci95": (floor.get("interval") or {}).get(f"p{q}") for q in (50, 90, 99)},
            "definition": floor.get("definition"),
            "full_step_rel_diff": plain_quantiles(
                abs(r["measured_step_s"] - r["measured_step_replicate_s"]) / r["measured_step_s"] for r in replicated
            ),
        }
        summary["additivity"][phase] = {
            "rms_residual_fraction": plain_quantiles(r["additive_fit"]["rms_residual_fraction"] for r in phase_records),
            "max_residual_fraction": plain_quantiles(r["additive_fit"]["max_residual_fraction"] for r in phase_records),
            "intercept_fraction_of_step": plain_quantiles(r["additive_fit"]["intercept_s"] / r["measured_step_s"] for r in phase_records),
            "model_subset_rel_err": plain_quantiles(
                abs(p - m) / m for r in phase_records for p, m in zip(r["model_subset_step_s"], r["subset_step_s"][0])
            ),
        }
        head = errors["shapley"][HEADLINE_METHOD]
        improvement = summary["improvement_vs_token_count"][phase][HEADLINE_METHOD]
        summary["goal_met"][phase] = {
            "median": head["p50"] <= GOAL["median_max"],
            "p90": head["p90"] <= GOAL["p90_max"],
            "vs_token_count": improvement is not None and improvement >= GOAL["p90_improvement_vs_token_count_min"],
        }
    summary["per_request_error"] = per_request_error(all_records, all_methods, n_bootstrap=n_bootstrap, seed=seed)
    summary["class_bias"], summary["class_definitions"] = class_bias(all_records, all_methods, n_bootstrap=n_bootstrap, seed=seed)
    summary["batch_sizes"] = batch_sizes(all_records)
    if sampled:
        summary["sampled"] = sampled_summary(sampled, n_bootstrap=n_bootstrap, seed=seed)
        summary["sampler_agreement"] = sampler_agreement(records, n_orders=agreement_orders, n_bootstrap=n_bootstrap, seed=seed)
    summary["interactions"] = interaction_diagnostics(records)
    summary["n_batches"] = {p: sum(r["phase"] == p for r in records) for p in PHASES}
    summary["n_requests"] = {p: sum(r["size"] for r in records if r["phase"] == p) for p in PHASES}
    summary["methods"] = methods
    return summary


def per_request_error(records: list[dict], methods: list[str], *, floor: float = RELATIVE_ERROR_FLOOR,
                      n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """|share − φ_i| / φ_i per request (the error on a request's own bill), per group (`record_group`) and method.

    Over requests with φ_i ≥ ``floor`` · T(B) (a smaller measured value is within the re-measuring noise, and a
    relative error on it says nothing); ``n_below_floor`` counts the rest.
    """
    out: dict = {}
    for group in record_groups(records):
        phase_records = [r for r in records if record_group(r) == group]
        out[group] = {}
        for method in methods:
            if not all(method in r["shares_s"] for r in phase_records):
                continue
            errors, groups, below = [], [], 0
            for r in phase_records:
                truth = np.asarray(r["shapley_s"])
                share = np.asarray(r["shares_s"][method])
                kept = truth >= floor * r["measured_step_s"]
                below += int((~kept).sum())
                errors.extend(np.abs(share[kept] - truth[kept]) / truth[kept])
                groups.extend([r["index"]] * int(kept.sum()))
            table = quantiles_with_ci(np.array(errors), np.array(groups), n_bootstrap=n_bootstrap, seed=seed)
            out[group][method] = {**table, "n_below_floor": below, "floor_fraction_of_step": floor}
    return out


def record_group(record: dict) -> str:
    """The group a batch record is summarised in: its phase for an exactly measured batch, its kind
    (``sampled_decode``, ``sampled_mixed``, ...) for a sampled one."""
    return record["kind"] if record.get("sampled") else record["phase"]


def record_groups(records: list[dict]) -> list[str]:
    present = {record_group(r) for r in records}
    return [g for g in (*PHASES, *(f"sampled_{k}" for k in SAMPLED_KINDS)) if g in present]


def request_lengths(record: dict) -> np.ndarray:
    """Each request's length for the classes: new + context tokens (decode: the context read; prefill: the prompt)."""
    return np.asarray(record["num_new_tokens"], dtype=np.float64) + np.asarray(record["num_context_tokens"], dtype=np.float64)


def request_classes(records: list[dict]) -> tuple[list[dict[str, np.ndarray]], dict]:
    """Per record, class name → mask over its requests; and what each class means (quartile edges included)."""
    masks: list[dict[str, np.ndarray]] = [{} for _ in records]
    definitions: dict = {
        "{phase}": "every request of that phase",
        "{phase}/length_qK": "length (new + context tokens) in the K-th quartile of that phase's requests",
        "{phase}/unique_context": "requests whose context is their own (no prefix shared with another request of the batch)",
        "{phase}/shared_context": "requests sharing a cached prefix with another request of the batch "
        "(absent when no measured batch has one: the shipped journal's contexts are all unique)",
        "{group}": "{phase} is the phase of exactly measured batches; sampled batches are classed the same way within "
        "their kind (sampled_decode, sampled_prefill, sampled_mixed, sampled_shared_prefix_decode)",
        "{phase}/small_in_batch": "length below its batch's median length",
        "{phase}/large_in_batch": "length above its batch's median length (a request at the median is in neither)",
        "quartile_edges": {},
    }
    for phase in record_groups(records):
        chosen = [k for k, r in enumerate(records) if record_group(r) == phase]
        edges = np.percentile(np.concatenate([request_lengths(records[k]) for k in chosen]), [25, 50, 75])
        definitions["quartile_edges"][phase] = edges.tolist()
        for k in chosen:
            r, lengths = records[k], request_lengths(records[k])
            shared = np.asarray(r.get("num_shared_context_tokens", np.zeros(r["size"])), dtype=np.float64) > 0
            quartile = np.searchsorted(edges, lengths, side="right")
            median = float(np.median(lengths))
            masks[k][phase] = np.ones(r["size"], dtype=bool)
            for q in range(4):
                masks[k][f"{phase}/length_q{q + 1}"] = quartile == q
            masks[k][f"{phase}/unique_context"] = ~shared
            masks[k][f"{phase}/shared_context"] = shared
            masks[k][f"{phase}/small_in_batch"] = lengths < median
            masks[k][f"{phase}/large_in_batch"] = lengths > median
    return masks, definitions


def class_bias(records: list[dict], methods: list[str], *, n_bootstrap: int = 1000, seed: int = 0) -> tuple[dict, dict]:
    """Σ shares / Σ measured Shapley − 1 over each class of requests: the bias a tenant's bill inherits.

    A per-request error averages out over a month of requests only if it is unbiased; this is what does not.
    The 95% interval resamples whole batches (their requests share measurements). Classes: `request_classes`.
    """
    masks, definitions = request_classes(records)
    present = {name for m in masks for name, mask in m.items() if mask.any()}
    order = ["", *(f"/length_q{q}" for q in range(1, 5)), "/small_in_batch", "/large_in_batch", "/unique_context", "/shared_context"]
    names = [f"{group}{suffix}" for group in record_groups(records) for suffix in order if f"{group}{suffix}" in present]
    resampled = bool(records) and n_bootstrap > 0
    out: dict = {}
    for name in names:
        out[name] = {}
        members_of = [(k, m[name]) for k, m in enumerate(masks) if name in m and m[name].any()]
        truth = np.zeros(len(records))
        for k, mask in members_of:
            truth[k] = np.asarray(records[k]["shapley_s"])[mask].sum()
        n = int(sum(mask.sum() for _, mask in members_of))
        chosen = [m for m in methods if all(m in records[k]["shares_s"] for k, _ in members_of)]
        billed = np.zeros((len(chosen), len(records)))
        for row, method in enumerate(chosen):
            for k, mask in members_of:
                billed[row, k] = np.asarray(records[k]["shares_s"][method])[mask].sum()
        if resampled and chosen:  # batches resampled (their requests share measurements); a resample without a positive total defines no bias
            def ratio(counts, billed=billed, truth=truth):
                total = counts @ truth
                biases = np.stack([(counts @ row) / np.maximum(total, 1e-300) - 1 for row in billed], axis=1)
                return np.where(total[:, None] > 0, biases, np.nan)

            low, high = bootstrap_interval(ratio, len(records), n_resamples=n_bootstrap, seed=seed, draw="counts")
        for row, method in enumerate(chosen):
            entry = {"bias": float(billed[row].sum() / truth.sum() - 1), "ci95": None, "n": n, "n_batches": len(members_of)}
            # None when no resample holds a positive total (a class in one batch whose estimated values sum below 0)
            if resampled and chosen and not math.isnan(low[row]):
                entry["ci95"] = [float(low[row]), float(high[row])]
            out[name][method] = entry
    return out, definitions


def batch_sizes(records: list[dict]) -> dict:
    """Smallest and largest batch measured, overall and per phase/kind."""
    out: dict = {"min": min(r["size"] for r in records), "max": max(r["size"] for r in records), "by_kind": {}}
    for key in sorted({f"{r['phase']}/{r['kind']}" for r in records}):
        sizes = [r["size"] for r in records if f"{r['phase']}/{r['kind']}" == key]
        out["by_kind"][key] = {"min": min(sizes), "max": max(sizes), "n_batches": len(sizes)}
    return out


def sampled_summary(records: list[dict], *, n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """Per kind of sampled batch: every method's |share − estimated Shapley| / T with batch-clustered intervals,
    and how wide the estimates' own 95% intervals are (part of that error is the estimator's, not the method's)."""
    out: dict = {}
    for group in record_groups(records):
        chosen = [r for r in records if record_group(r) == group]
        methods = [m for m in chosen[0]["shares_s"] if all(m in r["shares_s"] for r in chosen)]
        errors = _error_table(chosen, "shapley", methods, n_bootstrap, seed)
        token_p90 = errors[BASELINE_METHOD]["p90"] if BASELINE_METHOD in errors else None
        out[group] = {
            "n_batches": len(chosen),
            "n_requests": sum(r["size"] for r in chosen),
            "sizes": sorted({r["size"] for r in chosen}),
            "n_orders": sorted({r["n_orders"] for r in chosen}),
            "errors": errors,
            "improvement_vs_token_count": {m: (token_p90 / v["p90"] if token_p90 is not None and v["p90"] else None) for m, v in errors.items()},
            "estimate_ci95_half_width_fraction_of_step": plain_quantiles(
                (high - low) / 2 / r["measured_step_s"] for r in chosen for low, high in zip(*r["shapley_ci95_s"]) if low is not None
            ),
        }
    return out


def sampler_agreement(records: list[dict], *, n_orders: int, n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """The sampler checked where the truth is known: each exactly measured batch of 3 or more requests re-estimated
    from ``n_orders`` sampled orders of its own measured subsets (the model's game as control variate, as for
    serving-size batches); |estimate − exact| / T and how often the 95% interval holds the exact value."""
    chosen = [r for r in records if not r.get("sampled") and r["size"] >= 3]
    rng = np.random.default_rng([seed, 1])
    errors, groups, covered, half = [], [], [], []
    for r in chosen:
        n = r["size"]
        cost = np.concatenate([[0.0], r["subset_step_s"][0]])
        model_cost = np.concatenate([[0.0], r["model_subset_step_s"]])
        estimate = sampled_shapley(sample_orders(n, n_orders, rng), cost, control=model_cost, control_shapley=exact_shapley(model_cost))
        truth = np.asarray(r["shapley_s"])
        errors.extend(np.abs(estimate["shapley_s"] - truth) / r["measured_step_s"])
        groups.extend([f"{r['phase']}{r['index']}"] * n)
        covered.extend((estimate["ci_low_s"] <= truth + 1e-12) & (truth <= estimate["ci_high_s"] + 1e-12))
        half.extend((estimate["ci_high_s"] - estimate["ci_low_s"]) / 2 / r["measured_step_s"])
    return {
        "n_batches": len(chosen),
        "n_orders": n_orders,
        "abs_error_fraction_of_step": quantiles_with_ci(np.array(errors), np.array(groups), n_bootstrap=n_bootstrap, seed=seed),
        "ci95_coverage": float(np.mean(covered)) if covered else None,
        "ci95_half_width_fraction_of_step": plain_quantiles(half),
    }


def upgrade_result(result: dict) -> dict:
    """A result of any format version in today's names (a version-1 file's ``token_proportional`` is ``token_count``)."""
    if result.get("format_version", RESULT_FORMAT_VERSION) >= RESULT_FORMAT_VERSION:
        return result
    text = json.dumps(result)
    for old, new in LEGACY_NAMES.items():
        text = text.replace(f'"{old}"', f'"{new}"').replace(f"_{old}", f"_{new}")
    return json.loads(text)


METHOD_NOTES = {
    Method.SHAPLEY: "llmvisor default: own terms + equal split of the intercept, scaled to the measured step time",
    Method.SHAPLEY_PREDICTED: "the same from the model alone (shares sum to the predicted step time)",
    Method.PROPORTIONAL: "llmvisor: own terms only, scaled to the measured step time",
    Method.PROPORTIONAL_PREDICTED: "the same, scaled to the predicted step time",
    Method.PAPER: "llmvisor paper reading: own terms only, intercept and residual unattributed",
    Method.MODEL_EXACT_SHAPLEY: "exact Shapley value of the model's own game (every subset priced, in its own segment), scaled",
    Method.TOKEN_COUNT: "the measured step split by VTC's token prices, prompt ×1, output ×2 (a split by new tokens on prefill steps; "
    "an equal split on decode steps, where every request runs one output token)",
    Method.EQUAL_SPLIT: "the measured step split equally",
    Method.KV_TOKENS_PROPORTIONAL: "the measured step split by new + context tokens",
    Method.MEASURED_ADDITIVE_FIT: "not a method: Shapley of the best additive game fitted to the measured subsets (the limit of any own-terms + shared-intercept rule)",
}


def rounded(value, digits: int = 6):
    """A JSON-ready copy with floats to ``digits`` significant digits (far below the measurement noise)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def dumps_result(result: dict) -> str:
    """The result as JSON text: indented, except one compact line per batch record (keeps the file small)."""
    result = rounded(result)
    listed = [k for k in ("batches", "sampled_batches", "tenant_batches") if k in result]
    head = {k: val for k, val in result.items() if k not in listed}
    text = json.dumps(head, indent=1, allow_nan=False)[:-2]
    for key in listed:
        lines = ",\n".join("  " + json.dumps(b, separators=(",", ":"), allow_nan=False) for b in result[key])
        text += f',\n "{key}": [\n' + lines + "\n ]"
    return text + "\n}\n"


def _last_run_guard(settings: dict | None) -> InterferenceGuard | None:
    """The guard the last measuring run used (its redos, wait, canary spacing and carry, from ``settings.measurement_runs``), so
    the result states the rule it was measured under; the default redos and wait where no run recorded them. A run that
    recorded no carry was measured before batch-rounds opened with the previous round's closing canary (carry 0)."""
    runs = [r for r in (settings or {}).get("measurement_runs", []) if "guard_max_redos" in r]
    if not runs:
        return InterferenceGuard(carry_s=0.0)
    last = runs[-1]
    return InterferenceGuard(max_redos=int(last["guard_max_redos"]), max_wait_s=float(last.get("guard_max_wait_s", InterferenceGuard().max_wait_s)),
                             carry_s=float(last.get("guard_carry_s", 0.0)), every=int(last.get("guard_every", InterferenceGuard().every)))


def build_result(batches: list[BatchSpec], journal: Journal, model, *, repeat: int, n_bootstrap: int = 1000, seed: int = 0,
                 settings: dict | None = None, sampled_batches: list[SampledBatchSpec] = (), sampled_repeat: int | None = None,
                 agreement_orders: int = 8) -> dict:
    """The full validation result (JSON-ready): settings, per-batch records (``batches``: exact; ``sampled_batches``:
    serving-size, their Shapley values estimated from sampled orders), summary."""
    records = [r for r in (analyse_batch(b, journal, model, repeat) for b in batches) if r is not None]
    sampled = [r for r in (analyse_sampled_batch(b, journal, model, sampled_repeat or repeat) for b in sampled_batches) if r is not None]
    extra = {}
    if sampled_batches:
        extra = {"n_sampled_batches_planned": len(sampled_batches), "n_sampled_batches_measured": len(sampled), "sampled_batches": sampled}
    return {
        "format": RESULT_FORMAT,
        "format_version": RESULT_FORMAT_VERSION,
        "settings": dict(settings or {}),
        "method_notes": METHOD_NOTES,
        "n_batches_planned": len(batches),
        "n_batches_measured": len(records),
        "n_steps_rejected": journal.n_rejected,
        "interference": {
            "rule": guard_rule(_last_run_guard(settings)),
            "n_batch_rounds_discarded": len(journal.interference),
            "n_batches_flagged": sum(1 for r in records if r.get("interference_flagged")),
            "canary_s": plain_quantiles(journal.canary_s),
        },
        "summary": summarize(records + sampled, n_bootstrap=n_bootstrap, seed=seed, agreement_orders=agreement_orders),
        "batches": records,
        **extra,
    }


def model_step_s(model):
    """``step_s(batch, subset)`` for `llmvisor.validation.plans.sampled_run_budget_s`: the model's predicted time of
    a sampled batch's subset run alone (its nominal contexts, the shared prefix read once)."""
    games: dict[str, SubsetGame] = {}

    def step_s(batch: SampledBatchSpec, subset: int) -> float:
        if batch.key not in games:
            games[batch.key] = SubsetGame(model, np.array(batch.num_new_tokens), np.array(batch.num_context_tokens, dtype=np.float64),
                                         np.array(batch.is_prefill, dtype=bool), np.array(batch.shared_prefix_tokens, dtype=np.float64))
        return games[batch.key][subset]

    return step_s


def finite_or_none(values: np.ndarray) -> list[float | None]:
    """JSON-ready values, None where not finite (one antithetic pair of orders has no spread to estimate from)."""
    return [float(v) if math.isfinite(v) else None for v in np.asarray(values, dtype=np.float64)]


def sampled_preparation_s(batches: list[SampledBatchSpec], model) -> float:
    """Seconds of unmeasured prefill a sampled plan spends preparing its decode contexts, by the model: a batch with
    decodes has its contexts prefilled once (a shared prefix once), each request's prefill priced as one step of its
    own (an estimate: the engine packs several into one step). Its later orders find the same prompts' blocks in
    the prefix cache and are counted as free, as are the batches of a pool after its first (they hold its prefill)."""
    total = 0.0
    pools_seen: set[tuple] = set()
    for batch in batches:
        pool = getattr(batch, "pool_context_tokens", ())
        if pool:
            key = (pool, batch.pool_shared_prefix_tokens, batch.pool_groups)
            if key in pools_seen:
                continue
            pools_seen.add(key)
        contexts = [c for c, prefill in zip(batch.num_context_tokens, batch.is_prefill) if not prefill]
        if not contexts:
            continue
        prefix = max(batch.shared_prefix_tokens)
        lengths = [contexts[0]] + [c - prefix for c in contexts[1:]]
        game = SubsetGame(model, np.array(lengths, dtype=np.float64), np.zeros(len(lengths)), np.ones(len(lengths), dtype=bool))
        total += batch.rounds * sum(game[1 << i] for i in range(len(lengths)))
    return total


SAMPLED_KIND_PHASE = {"decode": Phase.DECODE.value, "prefill": Phase.PREFILL.value, "shared_prefix_decode": Phase.DECODE.value, "mixed": "mixed"}
"""The phase a sampled batch's record is filed under; its kind is ``sampled_<kind>``."""


def analyse_sampled_batch(batch: SampledBatchSpec, journal: Journal, model, repeat: int) -> dict | None:
    """A serving-size batch's Shapley values estimated from its measured order prefixes (the model's game as
    control variate), with 95% intervals, and every method's shares (those computable without all 2**n
    subsets); None until every prefix is measured.

    Shared KV (a shared-prefix decode batch): each request's shared context is what the engine recorded in the
    full batch's step (the prefix's whole KV blocks), and the model prices the batch and its subsets with the
    prefix read once (`llmvisor.core.game.shared_prefix_effective_context`, `llmvisor.core.game.SubsetGame`: the
    model's game of a batch, whose exact Shapley value is the ``shapley`` rule's predicted share, is the control variate)."""
    if batch.coalitions:
        return None  # measured on coalitions: judged by the regression estimator (llmvisor.validation.estimator)
    n = batch.size
    full = (1 << n) - 1
    cost: dict[int, float] = {}
    contexts: list[list[int]] = [[] for _ in range(n)]
    shared = np.zeros(n)
    for subset in batch.subsets():
        taken = journal.get(batch, 0, subset)[:repeat]
        if len(taken) < repeat:
            return None
        cost[subset] = float(np.median([m.step_latency_s for m in taken]))
        for m in taken:
            for i, c in zip(members(subset, n), m.num_context_tokens):
                contexts[i].append(c)
        if subset == full:
            recorded = [m.num_shared_context_tokens for m in taken if m.num_shared_context_tokens is not None]
            if recorded:
                shared = np.median(np.array(recorded, dtype=np.float64), axis=0)
    measured_s = cost[full]
    new = np.array(batch.num_new_tokens, dtype=np.float64)
    is_prefill = np.array(batch.is_prefill, dtype=bool)
    context = np.rint(np.array([np.mean(c) if c else nominal for c, nominal in zip(contexts, batch.num_context_tokens)]))
    effective = shared_prefix_effective_context(context, shared)
    shares = model_shares(model, new, context, is_prefill, measured_s, effective if shared.any() else None)
    control = SubsetGame(model, new, context, is_prefill, shared)
    estimate = sampled_shapley(np.array(batch.orders, dtype=np.int64), cost, antithetic=batch.antithetic,
                               control=control, control_shapley=shares[Method.SHAPLEY_PREDICTED])
    shares[Method.TOKEN_COUNT] = measured_s * token_count_split(new, is_prefill)
    shares[Method.EQUAL_SPLIT] = np.full(n, measured_s / n)
    kv = new + context
    shares[Method.KV_TOKENS_PROPORTIONAL] = measured_s * kv / kv.sum()
    return {
        "index": batch.index,
        "phase": SAMPLED_KIND_PHASE[batch.kind],
        "kind": f"sampled_{batch.kind}",
        "source": batch.source,
        "size": n,
        "sampled": True,
        "n_orders": estimate["n_orders"],
        "antithetic": batch.antithetic,
        "n_subsets_measured": len(cost),
        "num_new_tokens": list(batch.num_new_tokens),
        "nominal_context_tokens": list(batch.num_context_tokens),
        "num_context_tokens": context.tolist(),
        "is_prefill": [bool(v) for v in is_prefill],
        "shared_prefix_tokens": list(batch.shared_prefix_tokens),
        "num_shared_context_tokens": shared.tolist(),
        "effective_context_tokens": effective.tolist(),
        "measured_step_s": measured_s,
        "shapley_s": estimate["shapley_s"].tolist(),
        "shapley_std_err_s": finite_or_none(estimate["std_err_s"]),
        "shapley_ci95_s": [finite_or_none(estimate["ci_low_s"]), finite_or_none(estimate["ci_high_s"])],
        "shares_s": {k: np.asarray(v, dtype=np.float64).tolist() for k, v in shares.items()},
    }
