"""What the shipped validation journals support for issue #39, and what they do not (no engine).

- **Per tenant** (`llmvisor.validation.tenants.quarter_tenant_halfwidths`): a tenant's 95% half-width from the
  coalitions journal's regression covariance.
- **Estimator, honestly**: the permutation half-width *measured* on the prefix journal's serving-size batches (their
  sampled orders), against the regression's on the coalitions journal, both per √step, with a bootstrap interval on
  the ratio (different batches), and both on the very steps the prefix journal's orders measured
  (`permutation_vs_regression_same_steps`); the regression's coverage on every
  exactly solved batch of both journals, per size and coalition count, with its count and interval; and the bias of
  the additive projection (the Shapley value of the best additive game, the estimator's limit) against the exact
  value, per class, with an interval from the repeats.
- **Sharing rules**: the landed rule and three plausible wrong ones through the same class-bias check
  (`llmvisor.validation.coalitions.sharing_check`), with the batches a rule not flagged today would need; and the
  same on the sharing run (`validate --sharing-layout pairs`: each document read by a short and a long reader, the
  layout where the wrong rules depart from the landed one), when its result is given; and how far each wrong rule
  could depart from the landed one in any of a family of layouts, priced with each journal's own terms
  (`sharing_rule_reach`): whether more batches could flag it at all.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from scipy import stats

from llmvisor import shipped
from llmvisor.core.game import SubsetGame
from llmvisor.validation.coalitions import (
    CLASS_BIAS_MAX,
    LANDED_SHARING_RULE,
    SHARING_RULES,
    analyse_coalition_batch,
    crossfitted_models,
    engine_priced,
    pooled_class_bias,
    shared_read_saving,
    sharing_check,
    sharing_class_masks,
    sharing_rule_shares,
)
from llmvisor.validation.estimator import exact_batch_games, exact_coverage, load_validation, relative_weights, shapley_matrix
from llmvisor.validation.game import additive_design, regression_shapley
from llmvisor.validation.plans import SHORT_QUESTION_TOKENS
from llmvisor.validation.tenants import bootstrap_median_ratio, quarter_tenant_halfwidths

FIGURES_FORMAT = "llmvisor.validation.groundtruth"
COALITIONS_RESULT = "validation-coalitions.json"
COALITIONS_JOURNAL = "validation-coalitions.journal.jsonl.gz"
COVERAGE_COUNTS = {"2n+1": lambda n: 2 * n + 1, "4n+1": lambda n: 4 * n + 1, "all": lambda n: (1 << n) - 1}


def coalition_records(result_path: Path | None = None, journal_path: Path | None = None) -> tuple[list[dict], object]:
    """The coalitions journal's batches analysed afresh (`analyse_coalition_batch`: every sharing rule's shares)."""
    result_path = result_path or shipped.result_path(COALITIONS_RESULT)
    v = load_validation(result_path, journal_path or result_path.with_name(COALITIONS_JOURNAL))
    return [r for r in (analyse_coalition_batch(b, v.journal, v.model, 1) for b in v.sampled_batches) if r is not None], v


def measured_permutation_ratio(prefix_result: dict, records: list[dict], *, n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """Per size and kind both journals hold: the permutation estimate's measured 95% half-width (prefix journal: the
    sampled orders' own spread) ÷ the regression's measured one (coalitions journal), each ÷ step × √(measured steps of
    its batch), so the ratio is at equal steps; bootstrap interval resampling each journal's batches."""
    perm: dict[str, list[np.ndarray]] = {}
    for r in prefix_result.get("sampled_batches", []):
        low, high = (np.array([np.nan if v is None else v for v in side]) for side in r["shapley_ci95_s"])
        values = (high - low) / 2 / r["measured_step_s"] * math.sqrt(r["n_subsets_measured"])
        perm.setdefault(f"{r['size']}/{r['kind'].removeprefix('sampled_')}", []).append(values[np.isfinite(values)])
    reg: dict[str, list[np.ndarray]] = {}
    for r in records:
        if r.get("interference_flagged") or r.get("exact"):
            continue
        reg.setdefault(f"{r['size']}/{r['kind']}", []).append(np.asarray(r["half_s"]) / r["measured_step_s"] * math.sqrt(r["n_steps"]))
    out = {}
    for key in sorted(set(perm) & set(reg), key=lambda k: (int(k.split("/")[0]), k)):
        out[key] = bootstrap_median_ratio(perm[key], reg[key], n_bootstrap=n_bootstrap, seed=seed)
    return {"by_size_and_kind": out,
            "how": "permutation: 8 antithetic orders' measured 95% half-widths (prefix journal); regression: its measured "
            "half-widths (coalitions journal); both ÷ step × √(the batch's measured steps); ratio of medians, bootstrap "
            "over each journal's batches. Different batches and runs; on the same steps: permutation_vs_regression_same_steps",
            "needs_new_measurement": "the regression on its own design (complementary pairs) beside permutation on the same batches, same step budget"}


def permutation_vs_regression_same_steps(prefix, prefix_result: dict, *, n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """On the prefix journal's serving-size batches, both estimators on the very steps the sampled orders measured:
    the permutation estimate's 95% half-width (the orders' own spread, as shipped) against the regression's
    (`regression_shapley`, relative weights, the same control variate) fitted on those orders' prefixes. Per size and
    kind, the median over batches of each batch's median-over-requests ratio, with a bootstrap interval over batches.
    The regression runs on the permutation design's coalitions, not its own (random complementary pairs), so this
    bounds its gain from below; its coverage on that design is `coverage_exact_prefixes`."""
    records = {r["index"]: r for r in prefix_result.get("sampled_batches", [])}
    ratios: dict[str, list[float]] = {}
    steps: dict[str, list[int]] = {}
    for b in prefix.sampled_batches:
        r = records.get(b.index)
        if r is None or b.coalitions:
            continue
        masks = b.subsets()
        cost = [float(np.median([m.step_latency_s for m in prefix.journal.get(b, 0, s)[:1]])) for s in masks]
        control = SubsetGame(prefix.model, np.asarray(b.num_new_tokens, dtype=np.float64), np.asarray(r["num_context_tokens"], dtype=np.float64),
                             np.asarray(b.is_prefill, dtype=bool), np.asarray(r["num_shared_context_tokens"], dtype=np.float64))
        fit = regression_shapley(masks, cost, b.size, weights=relative_weights(masks, cost, b.size), control=control,
                                 control_shapley=np.asarray(r["shares_s"]["shapley_predicted"]))
        regression = (np.asarray(fit["ci_high_s"]) - np.asarray(fit["ci_low_s"])) / 2
        low, high = (np.array([np.nan if x is None else x for x in side]) for side in r["shapley_ci95_s"])
        permutation = (high - low) / 2
        ok = np.isfinite(permutation) & np.isfinite(regression)
        key = f"{b.size}/{r['kind'].removeprefix('sampled_')}"
        ratios.setdefault(key, []).append(float(np.median(permutation[ok]) / np.median(regression[ok])))
        steps.setdefault(key, []).append(len(masks))
    rng = np.random.default_rng([seed, 39, 7])
    out = {}
    for key in sorted(ratios, key=lambda k: (int(k.split("/")[0]), k)):
        x = np.asarray(ratios[key])
        boot = [float(np.median(x[rng.integers(0, x.size, x.size)])) for _ in range(n_bootstrap)]
        out[key] = {"ratio": float(np.median(x)), "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))] if boot else None,
                    "n_batches": int(x.size), "n_steps_per_batch_p50": float(np.median(steps[key]))}
    return {"by_size_and_kind": out,
            "how": "both estimators on the same measured steps (the prefix journal's sampled orders' prefixes): permutation's "
            "half-width from the orders' spread, the regression's from its residuals, same control variate; per batch the "
            "ratio of medians over requests, then the median over batches with a bootstrap interval over batches"}


def coverage_on_exact(games: list[dict], *, trials: int = 20, n_bootstrap: int = 1000, seed: int = 0,
                      design: str = "coalitions") -> dict:
    """The regression's interval coverage (`exact_coverage`, relative weights) on every exactly solved batch, pooled
    and per size and coalition count, with batch-clustered bootstrap intervals and the counts; ``design``: the
    coalitions drawn (`llmvisor.validation.estimator.COVERAGE_DESIGNS`)."""
    per: list[tuple[int, str, float, int]] = []  # (size, count label, covered fraction, estimates)
    for j, g in enumerate(games):
        n = g["batch"].size
        counts = {k: f for k, f in COVERAGE_COUNTS.items() if f(n) <= (1 << n) - 1 and (k == "all" or f(n) < (1 << n) - 1)}
        cov = exact_coverage([g], coalition_counts=counts, trials=trials, seed=seed + j, variant="relative_weights", min_size=4,
                             design=design)
        for label, row in cov["by_coalitions"].items():
            per.append((n, label, row["coverage_95"], row["n_estimates"]))
    rng = np.random.default_rng([seed, 39, 5])

    def block(rows: list[tuple[int, str, float, int]]) -> dict:
        hits = np.array([c * k for *_, c, k in rows])
        counts = np.array([k for *_, k in rows])
        boot = [hits[p].sum() / counts[p].sum() for p in (rng.integers(0, len(rows), len(rows)) for _ in range(n_bootstrap))]
        return {"coverage_95": float(hits.sum() / counts.sum()), "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
                "n_batch_counts": len(rows), "n_estimates": int(counts.sum())}

    return {
        "n_batches": len(games), "sizes": sorted({g["batch"].size for g in games}),
        "pooled": block(per) if per else None,
        "by_coalitions": {label: block([p for p in per if p[1] == label]) for label in COVERAGE_COUNTS if any(p[1] == label for p in per)},
        "by_size": {str(n): block([p for p in per if p[0] == n]) for n in sorted({p[0] for p in per})},
    }


def additive_projection_bias(games: list[dict], *, confidence: float = 0.95) -> dict:
    """Per class, Σ(φ_additive − φ_exact) ÷ Σ φ_exact over the exact batches (φ_additive: Shapley of the least-squares
    additive game of the same mean times, the limit the regression estimates), with a 95% interval from the batches'
    pure error (the difference is linear in the measured times); and per request |φ_additive − φ_exact| ÷ φ_exact."""
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    sums: dict[str, list[float]] = {}
    per_request = []
    for g in games:
        n = g["batch"].size
        times = g["times"]
        mean = times.mean(axis=1)
        pinv = np.linalg.pinv(additive_design(n))
        to_additive = pinv[1:] + pinv[0] / n
        diff_map = to_additive - shapley_matrix(n)
        exact = shapley_matrix(n) @ mean
        diff = diff_map @ mean
        var_mean = g["pure_error_var"] / times.shape[1]
        per_request.extend(np.abs(diff) / np.abs(exact))
        record = g["record"]
        groups = np.asarray(record.get("groups", [-1] * n))
        length = np.asarray(record.get("num_context_tokens") or [0] * n, dtype=np.float64)
        if not length.any():
            length = np.asarray(record.get("num_new_tokens", [0] * n), dtype=np.float64)
        classes = {"all": np.ones(n, dtype=bool), "long": length > np.median(length), "short": length <= np.median(length)}
        if (groups >= 0).any():
            classes |= {"shared_readers": groups >= 0, "own_contexts": groups < 0}
        for name, mask in classes.items():
            entry = sums.setdefault(name, [0.0, 0.0, 0.0, 0])
            row = diff_map[mask].sum(axis=0)
            entry[0] += float(diff[mask].sum())
            entry[1] += float(exact[mask].sum())
            entry[2] += float(row @ row) * var_mean
            entry[3] += 1
    out = {}
    for name, (d, e, var, k) in sums.items():
        se = math.sqrt(var) / e
        out[name] = {"bias": d / e, "ci95": [d / e - z * se, d / e + z * se], "n_batches": k}
    return {"by_class": out, "per_request_abs_fraction": {"p50": float(np.median(per_request)), "p90": float(np.percentile(per_request, 90)),
                                                          "n": len(per_request)},
            "how": "φ_additive of the mean times by ordinary least squares over every subset; interval: the batches' pure "
            "error carried through the (linear) difference"}


def sharing_rule_verdicts(records: list[dict], *, limit: float = CLASS_BIAS_MAX) -> dict:
    """Each sharing rule through the sharing check (`sharing_check`): flagged or not. For a wrong rule, the class that
    flagged it or, not flagged, any class: of those, the one where it departs most from the landed rule (its bias minus
    the landed rule's: what it would show were the landed rule right, and a flag the landed rule does not share) and
    the batches, at these steps per batch, that would put that class's interval wholly outside ±limit; None with
    ``below_tolerance`` where that departure is within the limit (this check cannot flag it at any size)."""
    check = sharing_check([r for r in records if not r.get("interference_flagged")])
    out: dict = {}
    for label, entry in check.items():
        landed = entry["rules"][LANDED_SHARING_RULE]["class_bias"]
        rules = {}
        for rule, row in entry["rules"].items():
            biases = {k: b for k, b in row["class_bias"].items() if b and landed.get(k)}
            if rule == LANDED_SHARING_RULE:
                rules[rule] = {"landed": True, "flagged": row["flagged"], "class_bias": row["class_bias"]}
                continue
            outside = [k for k in biases if row["verdict"].get(k) == "missed"]
            name = max(outside or biases, key=lambda k: abs(biases[k]["bias"] - landed[k]["bias"]))
            departure = biases[name]["bias"] - landed[name]["bias"]
            half = (biases[name]["ci95"][1] - biases[name]["ci95"][0]) / 2
            margin = abs(departure) - limit
            rules[rule] = {"landed": False, "flagged": row["flagged"], "deciding_class": name, "bias": biases[name]["bias"],
                           "ci95": biases[name]["ci95"], "departure_from_landed": departure, "below_tolerance": margin <= 0,
                           "batches_to_flag": None if row["flagged"] or margin <= 0 else math.ceil(entry["n_batches"] * (half / margin) ** 2),
                           "class_bias": row["class_bias"]}
        out[label] = {"n_batches": entry["n_batches"], "sizes": entry["sizes"], "limit": limit, "rules": rules}
    return out


REACH_SIZES = (16, 32, 64)
REACH_READERS_PER_DOCUMENT = (2, 3, 4, 6, 8)
REACH_DOCUMENT_SHARES = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7)
"""The layouts `sharing_rule_reach` searches: batch sizes, readers per document, and a document's tokens as a share of
the longest context."""


def sharing_rule_reach(model, *, max_context: int, sizes=REACH_SIZES, readers=REACH_READERS_PER_DOCUMENT,
                       document_shares=REACH_DOCUMENT_SHARES) -> dict:
    """How far each wrong sharing rule can bill a class of the check (`sharing_class_masks`) from the landed rule
    under ``model``'s prices, over decode batches whose documents are each read by one long reader (to
    ``max_context``) and short questions (`SHORT_QUESTION_TOKENS`' least own tokens), the documents filling half or
    all of the batch (the rest own contexts of half ``max_context``), the long reader prefilled first or last. Per
    rule, the layout and class where Σ its shares ÷ Σ the landed rule's − 1 is largest in size, and the largest such
    departure at each batch size (``by_size``: a model fitted on smaller batches extrapolates to the larger ones). Were
    the landed rule exactly right, that is the wrong rule's bias in that class. The check flags a rule only where a
    class's interval lies beyond ±`CLASS_BIAS_MAX`, so a rule whose reach is within it cannot be flagged on an engine
    these prices describe, however many batches are measured, and one just beyond it needs an interval narrower than
    the margin."""
    best: dict[tuple[str, int], dict] = {}
    question = SHORT_QUESTION_TOKENS[0]
    for size in sizes:
        for k in readers:
            for share in document_shares:
                document = int(max_context * share)
                if document < 1 or document + question >= max_context:  # nothing shared, or no reader longer than a question
                    continue
                for filled in (False, True):
                    n_documents = (size if filled else size // 2) // k
                    if n_documents < 1:
                        continue
                    groups = np.array([g for g in range(n_documents) for _ in range(k)] + [-1] * (size - n_documents * k))
                    shared = np.where(groups >= 0, float(document), 0.0)
                    group = [max_context] + [document + question] * (k - 1)
                    for long_first in (True, False):
                        context = np.array((group if long_first else group[::-1]) * n_documents
                                           + [max_context // 2] * (size - n_documents * k), dtype=np.float64)
                        shares = sharing_rule_shares(model, np.ones(size), context, np.zeros(size, dtype=bool), 1.0, shared, groups)
                        landed = shares[LANDED_SHARING_RULE]
                        for name, mask in sharing_class_masks(groups, context).items():
                            if not mask.any():
                                continue
                            for rule in SHARING_RULES[1:]:
                                departure = float(shares[rule][mask].sum() / landed[mask].sum() - 1)
                                if abs(departure) > abs(best.get((rule, size), {}).get("departure", 0.0)):
                                    best[rule, size] = {"departure": departure, "class": name, "size": size, "readers_per_document": k,
                                                        "document_tokens": document, "documents": n_documents,
                                                        "long_reader_first": long_first}
    rules = {}
    for rule in SHARING_RULES[1:]:
        found = [best[rule, size] for size in sizes if (rule, size) in best]
        top = max(found, key=lambda r: abs(r["departure"]), default={"departure": 0.0})
        rules[rule] = {**top, "by_size": {str(r["size"]): r["departure"] for r in found}}
    return {"shared_read_saving": shared_read_saving(model), "max_context": max_context, "rules": rules}


def _own_terms(v, records: list[dict]) -> tuple[list[dict], dict, list[dict]]:
    """A journal's records priced with its own cross-fitted terms (`engine_priced`), how, and each fold model's
    `sharing_rule_reach` within the journal's longest planned context."""
    kept = [r for r in records if not r.get("interference_flagged")]
    models = crossfitted_models(v.sampled_batches, v.journal, {r["index"] for r in kept})
    priced, pricing = engine_priced(v.sampled_batches, v.journal, records, v.model, models=models)
    max_context = max(max(b.num_context_tokens) for b in v.sampled_batches)
    reach = [sharing_rule_reach(m, max_context=max_context) for m in {id(m): m for m in models.values()}.values()]
    return priced, pricing, reach


def n_mixed_sharing_request_sets(records: list[dict]) -> int:
    """The serving-size mixed-sharing batches the sharing check judges (each an independent request set)."""
    return sum(1 for r in records if r["kind"] == "mixed_sharing_decode" and not r.get("exact") and not r.get("interference_flagged"))


def sharing_run_figures(result_path: Path) -> dict:
    """The sharing run's verdicts (`sharing_rule_verdicts` on its serving-size batches) priced with the run's own
    cross-fitted terms (`engine_priced`) and, beside them, with the shipped model; its plan and what measuring it cost
    (the result's own `summary.measurement_cost`: steps per wall second, engine starts included)."""
    records, v = coalition_records(result_path, result_path.with_name(result_path.name.removesuffix(".json") + ".journal.jsonl.gz"))
    result = json.loads(result_path.read_text(encoding="utf-8"))
    sampled = result["settings"]["sampled"]
    priced, pricing, reach = _own_terms(v, records)
    return {"source": result_path.name,
            "plan": {k: sampled.get(k) for k in ("batches", "sizes", "kinds", "coalitions_per_request", "sharing_layout")},
            "n_request_sets": n_mixed_sharing_request_sets(records),
            "n_interference_flagged": sum(1 for r in records if r.get("interference_flagged")),
            "pricing": pricing,
            "rules": sharing_rule_verdicts(priced)["serving_size"],
            "reach": reach,
            "own_context_controls": own_context_controls(priced),
            "shipped_model": {"rules": sharing_rule_verdicts(records)["serving_size"], "own_context_controls": own_context_controls(records)},
            "measurement_cost": result["summary"]["measurement_cost"]}


OWN_CONTEXT_CONTROLS = {"own_context_below_600": (0, 600), "own_context_from_2000": (2000, None)}
"""Requests of their own context (no document) by context length: whether a class bias of a document's short or long
readers shows on requests that share nothing (the model's price of a context) or only on readers (the split)."""


def own_context_controls(records: list[dict]) -> dict:
    """The landed rule's class bias (`pooled_class_bias`) of the `OWN_CONTEXT_CONTROLS` classes in the batches."""
    out = {}
    for name, (low, high) in OWN_CONTEXT_CONTROLS.items():
        rows = []
        for r in records:
            if r.get("interference_flagged") or r.get("exact"):
                continue
            context = np.asarray(r["num_context_tokens"])
            mask = (np.asarray(r["groups"]) < 0) & (context >= low) & (context < (high or np.inf))
            rows.append((np.asarray(r["sharing_rule_shares_s"][LANDED_SHARING_RULE]), np.asarray(r["shapley_s"]), np.asarray(r["cov_s2"]), mask))
        out[name] = pooled_class_bias(rows)
    return out


def groundtruth_figures(*, seed: int = 0, n_bootstrap: int = 1000, trials: int = 20, sharing_result: Path | None = None) -> dict:
    """Every figure of this module from the shipped journals, JSON-ready (`jsonable`); ``sharing_result``: the sharing
    run's result (its gzipped journal beside it)."""
    from llmvisor.validation.coalitions import jsonable

    records, v = coalition_records()
    priced, pricing, reach = _own_terms(v, records)
    coalitions_result = json.loads(shipped.result_path(COALITIONS_RESULT).read_text(encoding="utf-8"))
    noise = coalitions_result["summary"]["noise_floor"]["relative_per_measurement"]
    planned = coalitions_result["settings"]["sampled"]
    overhead = coalitions_result["summary"]["measurement_cost"]["wall_s"] / (planned["model_budget_s"] + planned["model_preparation_s"])
    prefix = load_validation()
    prefix_result = json.loads(shipped.result_path(shipped.VALIDATION_RESULT).read_text(encoding="utf-8"))
    prefix_games = [g for g in exact_batch_games(prefix, int(prefix.settings["repeat"])) if g["batch"].size >= 4]
    sharing_games = [{"batch": _Size(r["size"]), "record": r, "times": r["times"], "pure_error_var": r["pure_error_var"]}
                     for r in records if "exact_shapley_s" in r]
    return jsonable({
        "format": FIGURES_FORMAT, "seed": seed,
        "sources": {"prefix_journal": shipped.VALIDATION_JOURNAL, "coalitions_journal": COALITIONS_JOURNAL},
        "tenants_from_old_journal": quarter_tenant_halfwidths(records, n_bootstrap=n_bootstrap, seed=seed),
        "estimator": {
            "permutation_vs_regression_measured": measured_permutation_ratio(prefix_result, records, n_bootstrap=n_bootstrap, seed=seed),
            "permutation_vs_regression_same_steps": permutation_vs_regression_same_steps(prefix, prefix_result, n_bootstrap=n_bootstrap, seed=seed),
            "coverage_exact_prefixes": coverage_on_exact(prefix_games + sharing_games, trials=trials, n_bootstrap=n_bootstrap, seed=seed,
                                                         design="prefixes"),
            "coverage_exact": {"prefix_journal": coverage_on_exact(prefix_games, trials=trials, n_bootstrap=n_bootstrap, seed=seed),
                               "mixed_sharing": coverage_on_exact(sharing_games, trials=trials, n_bootstrap=n_bootstrap, seed=seed),
                               "all": coverage_on_exact(prefix_games + sharing_games, trials=trials, n_bootstrap=n_bootstrap, seed=seed)},
            "additive_projection_bias": {"prefix_journal": additive_projection_bias(prefix_games),
                                         "mixed_sharing": additive_projection_bias(sharing_games)},
        },
        "sharing_rules": sharing_rule_verdicts(priced),
        "sharing_rules_pricing": pricing,
        "sharing_rules_reach": reach,
        "sharing_rules_shipped_model": sharing_rule_verdicts(records),
        "tenant_run_plan": tenant_run_plan(noise_fraction=float(noise["p50"]), overhead=overhead, seed=seed),
        "n_serving_size_batches": sum(1 for r in records if not r.get("exact") and not r.get("interference_flagged")),
        "n_mixed_sharing_request_sets": n_mixed_sharing_request_sets(records),
        **({"sharing_run": sharing_run_figures(Path(sharing_result))} if sharing_result else {}),
    })


class _Size:
    """The size `exact_coverage` reads from a batch."""

    def __init__(self, size: int):
        self.size = size


def tenant_run_plan(*, noise_fraction: float, overhead: float, n_batches: int = 54, repeats=(6, 12, 24, 48), rounds: int = 2,
                    seed: int = 0) -> dict:
    """What the tenants plan needs, by the model (no measurement): per repeat count K and batch size, the median
    95% half-width ÷ share a tenant's value would have if each step's noise were ``noise_fraction`` of its time (the
    coalitions journal's replicate floor), priced with the shipped model's game of each tenant batch; its steps, and
    the hours: the model's time of the steps and of preparing the decode contexts each round
    (`llmvisor.validation.analysis.sampled_preparation_s`) times ``overhead`` (the coalitions journal's wall time ÷
    its plan's model time: engine starts, canaries, the loop), and the same at 3× the speed."""
    from llmvisor.core.game import SubsetGame
    from llmvisor.core.model import StepLatencyModel
    from llmvisor.validation.analysis import sampled_preparation_s
    from llmvisor.validation.plans import Envelope, draw_tenant_batches, read_length_mixes, tenant_coalition_masks

    model = StepLatencyModel.from_json(shipped.latency_model_path())
    batches = draw_tenant_batches(read_length_mixes(), Envelope(4096, 2048, 64), n_batches=n_batches, repeat=1, rounds=1, seed=seed)
    out: dict = {"noise_fraction_of_step": noise_fraction, "overhead": overhead, "n_batches": n_batches, "rounds": rounds,
                 "sizes": sorted({b.size for b in batches}), "by_repeat": {}}
    games = []
    for b in batches:
        game = SubsetGame(model, np.array(b.num_new_tokens), np.array(b.num_context_tokens, dtype=np.float64),
                          np.array(b.is_prefill, dtype=bool), np.array(b.shared_prefix_tokens, dtype=np.float64))
        n_t = len(b.tenant_roles)
        cost = np.array([game[m] for m in tenant_coalition_masks(b.tenants)[::-1]])  # tenant masks 1 … 2**T − 1
        counts = np.bincount(np.asarray(b.tenants), minlength=n_t)
        pinv = np.linalg.pinv(additive_design(n_t))
        games.append((b, cost, pinv[1:] + np.outer(counts / counts.sum(), pinv[0])))
    preparation_s = rounds * sampled_preparation_s(batches, model)
    for k in repeats:
        halves: dict[int, list[float]] = {}
        step_s = 0.0
        for b, cost, linear in games:
            sd = np.sqrt((linear**2) @ ((noise_fraction * cost) ** 2 / (k * rounds)))
            halves.setdefault(b.size, []).extend(1.96 * sd / (linear @ cost))
            step_s += float(cost.sum()) * k * rounds
        hours = overhead * (step_s + preparation_s) / 3600
        out["by_repeat"][str(k)] = {
            "halfwidth_over_share_p50": {str(s): float(np.median(v)) for s, v in sorted(halves.items())},
            "steps": sum(len(cost) for _, cost, _ in games) * k * rounds, "model_step_s": step_s, "model_preparation_s": preparation_s,
            "hours_now": hours, "hours_at_3x": hours / 3}
    out["how"] = ("model-priced tenant games of the plan; per coalition a mean of K × rounds steps with relative noise "
                  "noise_fraction (median over tenants, normal quantile); hours = overhead × (model step time + model "
                  "preparation time), overhead the coalitions journal's wall time ÷ its plan's model time")
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ci(entry: list[float]) -> str:
    return f"[{_pct(entry[0])}, {_pct(entry[1])}]"


def _worst_class(row: dict) -> tuple[str, dict]:
    """A rule's class billed furthest from its measured value (largest |bias|), and that class's bias."""
    return max(((k, b) for k, b in row["class_bias"].items() if b), key=lambda kb: abs(kb[1]["bias"]))


def markdown_summary(figures: dict) -> str:
    """docs/validation.md's tables of `docs/results/ground-truth.json`, so the doc quotes the file and nothing else."""
    quarter = figures["tenants_from_old_journal"]["quarter"]
    lines = ["| requests | batches | tenant's 95% half-width ÷ share (p50) [95%] | bill's distance from the estimate ÷ estimate, p90 [95%] |",
             "| --- | --- | --- | --- |"]
    for size, row in quarter.items():
        err = row["error_vs_estimate"]
        lines.append(f"| {size} | {row['n_batches']} | {_pct(row['halfwidth_over_share']['p50'])} {_ci(row['halfwidth_over_share']['p50_ci95'])} | "
                     f"{_pct(err['p90'])} {_ci(err['p90_ci95'])} |")
    est = figures["estimator"]
    lines += ["", "| requests / kind | permutation ÷ regression half-width at equal steps (measured) [95%] |", "| --- | --- |"]
    for key, row in est["permutation_vs_regression_measured"]["by_size_and_kind"].items():
        lines.append(f"| {key} | {row['ratio']:.2f}× [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}] |")
    lines += ["", "| requests / kind | permutation ÷ regression half-width on the same measured steps [95%] | batches | steps per batch |",
              "| --- | --- | --- | --- |"]
    for key, row in est["permutation_vs_regression_same_steps"]["by_size_and_kind"].items():
        lines.append(f"| {key} | {row['ratio']:.2f}× [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}] | {row['n_batches']} | "
                     f"{row['n_steps_per_batch_p50']:.0f} |")
    cov = est["coverage_exact"]["all"]
    lines += ["", f"Coverage of the regression's 95% intervals on {cov['n_batches']} exactly solved batches "
              f"({', '.join(map(str, cov['sizes']))} requests): {_pct(cov['pooled']['coverage_95'])} {_ci(cov['pooled']['ci95'])}; "
              + "; ".join(f"{k}: {_pct(v['coverage_95'])} {_ci(v['ci95'])}" for k, v in cov["by_coalitions"].items()) + "."]
    prefixes = est["coverage_exact_prefixes"]
    lines += ["", f"The same with the coalitions drawn as the prefixes of random antithetic orders (the permutation design's steps), "
              f"on the same {prefixes['n_batches']} batches: {_pct(prefixes['pooled']['coverage_95'])} {_ci(prefixes['pooled']['ci95'])}; "
              + "; ".join(f"{k}: {_pct(v['coverage_95'])} {_ci(v['ci95'])}" for k, v in prefixes["by_coalitions"].items()) + "."]
    bias = est["additive_projection_bias"]
    lines += ["", "Additive projection (the estimator's limit) against the exact value, Σ(φ_additive − φ) ÷ Σφ [95%]: "
              + "; ".join(f"{label} {name.replace('_', ' ')} {_pct(b['bias'])} {_ci(b['ci95'])}"
                          for label, part in bias.items() for name, b in part["by_class"].items() if name != "all") + "."]
    lines += ["", "| sharing rule | batches | flagged | deciding class | its bias [95%] | departure from the landed rule | batches to flag |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    parts = list(figures["sharing_rules"].items())
    if "sharing_run" in figures:
        parts.append(("sharing_run_pairs", figures["sharing_run"]["rules"]))
    for label, part in parts:
        for rule, row in part["rules"].items():
            if row["landed"]:
                name, worst = _worst_class(row)
                lines.append(f"| {rule.replace('_', ' ')} (landed, {label.replace('_', ' ')}) | {part['n_batches']} | "
                             f"{'yes' if row['flagged'] else 'no'} | {name.replace('_', ' ')} | {_pct(worst['bias'])} {_ci(worst['ci95'])} | – | – |")
                continue
            # batches_to_flag is None exactly where the rule is flagged or its departure is below the limit
            needed = "–" if row["flagged"] else "below ±3%: cannot" if row["below_tolerance"] else f"{row['batches_to_flag']}"
            lines.append(f"| {rule.replace('_', ' ')} ({label.replace('_', ' ')}) | {part['n_batches']} | {'yes' if row['flagged'] else 'no'} | "
                         f"{row['deciding_class'].replace('_', ' ')} | {_pct(row['bias'])} {_ci(row['ci95'])} | "
                         f"{_pct(row['departure_from_landed'])} | {needed} |")
    shipped_parts = list(figures["sharing_rules_shipped_model"].items())
    if "sharing_run" in figures:
        shipped_parts.append(("sharing_run_pairs", figures["sharing_run"]["shipped_model"]["rules"]))
    landed_shipped = []
    for label, part in shipped_parts:
        row = part["rules"][LANDED_SHARING_RULE]
        name, worst = _worst_class(row)
        landed_shipped.append(f"{label.replace('_', ' ')} {'flagged' if row['flagged'] else 'not flagged'} ({name.replace('_', ' ')} "
                              f"{_pct(worst['bias'])} {_ci(worst['ci95'])})")
    savings = [("coalitions journal", figures["sharing_rules_pricing"])]
    if "sharing_run" in figures:
        savings.append(("sharing run", figures["sharing_run"]["pricing"]))
    lines += ["", "Rules priced with each journal's own terms (llmvisor's fit on the other request sets, "
              f"{figures['sharing_rules_pricing']['n_folds']} folds by request set). Priced with the shipped model instead, the landed rule is: "
              + "; ".join(landed_shipped) + ". A second reader of a KV block saves this share of a decode context token's price: "
              + "; ".join(f"{name} {_pct(min(min(f['shared_read_saving']) for f in how['folds']))}–"
                          f"{_pct(max(max(f['shared_read_saving']) for f in how['folds']))} (its folds)" for name, how in savings)
              + f"; the shipped model {' / '.join(_pct(x) for x in figures['sharing_rules_pricing']['model_shared_read_saving'])} "
              "(its two segments)."]
    reaches = [("coalitions journal", figures["sharing_rules_reach"])]
    if "sharing_run" in figures:
        reaches.append(("sharing run", figures["sharing_run"]["reach"]))
    lines += ["", "How far each wrong rule can bill a class from the landed rule's bill, over decode layouts of up to "
              f"{max(REACH_SIZES)} requests (`sharing_rule_reach`), priced with each fold's terms:", "",
              "| wrong rule | " + " | ".join(f"{name}'s terms: reach (its folds) | where most" for name, _ in reaches) + " |",
              "| --- |" + " --- | --- |" * len(reaches)]
    for rule in SHARING_RULES[1:]:
        cells = []
        for _, folds in reaches:
            values = sorted((f["rules"][rule] for f in folds), key=lambda r: abs(r["departure"]))
            most = values[-1]
            cells += [f"{_pct(values[0]['departure'])} to {_pct(most['departure'])}",
                      f"{most['size']} requests, {most['readers_per_document']} readers of each {most['document_tokens']:,}-token "
                      f"document, {most['class'].replace('_', ' ')}"]
        lines.append(f"| {rule.replace('_', ' ')} | " + " | ".join(cells) + " |")
    plan = figures["tenant_run_plan"]
    lines += ["", f"Tenants plan by the model ({plan['n_batches']} batches, {plan['rounds']} rounds, step noise "
              f"{_pct(plan['noise_fraction_of_step'])}, overhead {plan['overhead']:.1f}× the model's time):", "",
              "| repeats per coalition and round | half-width ÷ share p50 (16 / 32 / 64) | steps | hours now | hours at 3× |",
              "| --- | --- | --- | --- | --- |"]
    for k, row in plan["by_repeat"].items():
        lines.append(f"| {k} | {' / '.join(_pct(v) for v in row['halfwidth_over_share_p50'].values())} | {row['steps']:,} | "
                     f"{row['hours_now']:.2f} | {row['hours_at_3x']:.2f} |")
    run = figures.get("sharing_run")
    if run:
        plan, cost = run["plan"], run["measurement_cost"]
        lines += ["", f"Sharing run, measured (`{run['source']}`): {run['n_request_sets']} mixed-sharing batches of "
                  f"{', '.join(map(str, plan['sizes']))} requests in the {plan['sharing_layout']} layout at {plan['coalitions_per_request']:g} "
                  f"coalitions per request ({run['n_interference_flagged']} left out by the interference guard), "
                  f"{cost['n_steps_measured']:,} steps in {cost['wall_s'] / 60:.0f} minutes: {cost['steps_per_wall_s']:.1f} measured steps "
                  f"per second, engine start, preparation, canaries and the guard's waits included."]
    return "\n".join(lines)

