"""Serving-size validation on random complementary coalitions: the regression estimator's values, their precision
against permutation sampling, additivity against the batch's own replicates, and sharing checked within batches
that mix prefix groups with own contexts.

A coalitions-design batch (`llmvisor.validation.plans.draw_coalition_batches`) is measured on the full batch and
complementary pairs (round 0, in chunks: one batch-round each) and re-measures a share of them (round 1). Its
Shapley values are `llmvisor.validation.game.regression_shapley`'s (weights 1/T̂², an offset per chunk: the
estimator's headline variant); the exact mixed-sharing batches (every subset, twice) have exact values, on which
the regression's coverage is judged as in `llmvisor.validation.estimator.exact_coverage`.

Sharing rules are judged by the class bias of the ``shapley`` rule's shares, shared-prefix readers against own
contexts, *within* the mixed batches (a batch's efficiency no longer forces the bias to 0): the rule the attribution
uses (a group's shared blocks split among the step's readers of that group) and a planted wrong one (each reader
pays the whole block), which the check must flag.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from scipy import stats

from llmvisor.core.game import shared_prefix_effective_context
from llmvisor.core.model import StepLatencyModel, group_k_fold
from llmvisor.core.stats import replicate_noise_floor
from llmvisor.core.trace import StepTrace, build_trace
from llmvisor.errors import LlmvisorError
from llmvisor.validation.analysis import GOAL, Method, model_shares, plain_quantiles, token_count_split
from llmvisor.validation.estimator import exact_coverage, relative_weights, shapley_matrix
from llmvisor.validation.game import additivity_test, exact_shapley, members, regression_shapley
from llmvisor.validation.measurement import Journal, Measurement
from llmvisor.validation.plans import SHARED_KINDS, SampledBatchSpec

SHARING_RULES = ("split_among_readers", "whole_block_per_reader", "first_reader_pays", "split_by_context_length")
"""The sharing rule the attribution uses (a group's shared blocks split equally among the step's readers of that
group), then plausible wrong ones the check must flag: no split (each reader pays the whole block), the first reader
(the one that computed the blocks: prefilled first) pays the whole block and the later readers none of it, and the
block split in proportion to each reader's context length instead of equally."""
LANDED_SHARING_RULE = SHARING_RULES[0]
SHARING_CLASSES = ("shared", "unique", "largest_group", "middle_group", "smallest_group", "first_readers", "later_readers",
                   "long_readers", "short_readers", "longest_readers", "shortest_readers")
"""Classes whose bill the sharing check compares with their measured value: readers of a shared prefix against own
contexts, each prefix group by size rank, and within the groups: each group's first reader against the later ones, and
readers whose context is longer than their group's median against the shorter ones, and each group's longest and
shortest reader. Defined by the batch, not by any
rule, so every rule is judged on the same classes."""
CLASS_BIAS_MAX = 0.03
"""|class bias| the default rule must stay within (issue #21's goal)."""
HALFWIDTH_DECIDABLE_MAX = 0.25
"""A kind's median 95% half-width ÷ share at most this: a 10% p90 goal is decidable on it."""
METHODS = (Method.SHAPLEY, Method.TOKEN_COUNT, Method.EQUAL_SPLIT)


def grouped_effective_context(context, shared_context, groups) -> np.ndarray:
    """Each request's effective context when each prefix group's readers in a step split that group's shared tokens
    (`llmvisor.core.game.shared_prefix_effective_context` within each group; group −1 reads its own context)."""
    context = np.asarray(context, dtype=np.float64)
    shared = np.asarray(shared_context, dtype=np.float64)
    groups = np.asarray(groups)
    out = context.copy()
    for g in set(groups.tolist()) - {-1}:
        idx = np.flatnonzero(groups == g)
        out[idx] = shared_prefix_effective_context(context[idx], shared[idx])
    return out


def sharing_effective_context(rule: str, context, shared_context, groups) -> np.ndarray:
    """Each request's effective context under a sharing ``rule`` (`SHARING_RULES`) for a step of the whole batch; group
    −1 reads its own context, and a group's first reader is its lowest-numbered request (the one prefilled first)."""
    context = np.asarray(context, dtype=np.float64)
    shared = np.asarray(shared_context, dtype=np.float64)
    groups = np.asarray(groups)
    if rule == "split_among_readers":
        return grouped_effective_context(context, shared, groups)
    if rule == "whole_block_per_reader":
        return context.copy()
    out = context.copy()
    for g in set(groups.tolist()) - {-1}:
        idx = np.flatnonzero((groups == g) & (shared > 0))
        if idx.size < 2:
            continue
        if rule == "first_reader_pays":
            out[idx[1:]] -= shared[idx[1:]]
        elif rule == "split_by_context_length":
            block = float(shared[idx].max())
            out[idx] = context[idx] - shared[idx] + block * context[idx] / context[idx].sum()
        else:
            raise ValueError(f"unknown sharing rule {rule!r} (choose from {', '.join(SHARING_RULES)})")
    return out


def sharing_class_masks(groups, context) -> dict[str, np.ndarray]:
    """`SHARING_CLASSES` of one batch as request masks (a class the batch lacks is all False)."""
    groups = np.asarray(groups)
    context = np.asarray(context, dtype=np.float64)
    out = {"shared": groups >= 0, "unique": groups < 0}
    ranked = sorted({g for g in groups.tolist() if g >= 0}, key=lambda g: -int((groups == g).sum()))
    names = ("largest_group", "middle_group", "smallest_group") if len(ranked) == 3 else ("largest_group", "smallest_group")
    for name, g in zip(names, ranked, strict=False):
        out[name] = groups == g
    first = np.zeros(groups.size, dtype=bool)
    long = np.zeros(groups.size, dtype=bool)
    longest = np.zeros(groups.size, dtype=bool)
    shortest = np.zeros(groups.size, dtype=bool)
    for g in ranked:
        idx = np.flatnonzero(groups == g)
        first[idx[0]] = True
        long[idx] = context[idx] > np.median(context[idx])
        longest[idx[np.argmax(context[idx])]] = True
        shortest[idx[np.argmin(context[idx])]] = True
    out["first_readers"], out["later_readers"] = first, (groups >= 0) & ~first
    out["long_readers"], out["short_readers"] = long, (groups >= 0) & ~long
    out["longest_readers"], out["shortest_readers"] = longest, shortest
    return out


def _times(journal: Journal, batch: SampledBatchSpec, round_: int, subset: int, repeat: int) -> list[float]:
    return [m.step_latency_s for m in journal.get(batch, round_, subset)[:repeat]]


def analyse_coalition_batch(batch: SampledBatchSpec, journal: Journal, model, repeat: int = 1, *,
                            confidence: float = 0.95) -> dict | None:
    """One coalitions-design batch: regression values with intervals, every rule's shares (both sharing rules for
    batches with shared prefixes), the additivity test against the batch's replicates and their noise floor; None
    until round 0 is measured."""
    n, full = batch.size, (1 << batch.size) - 1
    masks, cost, blocks = [], [], []
    n_disturbed = 0
    for k, chunk in enumerate(batch.chunks(0)):
        for s in chunk:
            taken = journal.get(batch, 0, s)[:repeat]
            if len(taken) < repeat:
                return None
            if any(m.interference for m in taken):
                # kept after every redo was disturbed: left out of the fit (an exact batch is then left out whole)
                n_disturbed += 1
                continue
            masks.append(s)
            cost.append(float(np.median([m.step_latency_s for m in taken])))
            blocks.append(k)
    cost = np.array(cost)
    reps = {s: _times(journal, batch, 1, s, repeat) for s in batch.replicated if s in set(masks)} if batch.rounds > 1 else {}
    reps = {s: t for s, t in reps.items() if t and not any(m.interference for m in journal.get(batch, 1, s)[:repeat])}
    if full not in masks or len(masks) < 2 * n + 1 or (batch.size < 16 and n_disturbed):
        return {"interference_flagged": True, "index": batch.index, "kind": batch.kind, "size": n, "exact": batch.size < 16,
                "n_disturbed_steps": n_disturbed}
    exact = batch.size < 16 and len(set(masks)) == full
    # An exact batch's chunks are runs of its subsets in mask order (each holds or lacks the top request): an offset
    # per chunk would be confounded with that request, so its fit has none.
    fit = regression_shapley(masks, cost, n, weights=relative_weights(masks, cost, n), blocks=None if exact else blocks,
                             confidence=confidence)
    full_taken = journal.get(batch, 0, full)[:repeat]
    measured_s = float(np.median([m.step_latency_s for m in full_taken]))
    recorded = [m.num_shared_context_tokens for m in full_taken if m.num_shared_context_tokens is not None]
    shared = np.median(np.array(recorded, dtype=np.float64), axis=0) if recorded else np.zeros(n)
    contexts: list[list[int]] = [[] for _ in range(n)]
    for s in masks:
        for m in journal.get(batch, 0, s)[:repeat]:
            for i, c in zip(members(s, n), m.num_context_tokens, strict=False):
                contexts[i].append(c)
    context = np.rint(np.array([np.mean(c) if c else nominal for c, nominal in zip(contexts, batch.num_context_tokens, strict=True)]))
    new = np.array(batch.num_new_tokens, dtype=np.float64)
    is_prefill = np.array(batch.is_prefill, dtype=bool)
    shares = sharing_rule_shares(model, new, context, is_prefill, measured_s, shared, batch.groups)
    by_method = {
        Method.SHAPLEY.value: shares[SHARING_RULES[0]],
        Method.TOKEN_COUNT.value: measured_s * token_count_split(new, is_prefill),
        Method.EQUAL_SPLIT.value: np.full(n, measured_s / n),
    }
    all_masks = masks + [s for s, t in reps.items() for _ in t]
    all_cost = np.concatenate([cost, [x for t in reps.values() for x in t]])
    additivity = additivity_test(all_masks, all_cost, n, weights=relative_weights(all_masks, all_cost, n)) if reps else None
    pairs = [[float(np.median(_times(journal, batch, 0, s, repeat))), float(np.median(t))] for s, t in reps.items()]
    record = {
        "interference_flagged": False, "n_disturbed_steps": n_disturbed,
        "index": batch.index, "kind": batch.kind, "size": n, "source": batch.source, "exact": exact,
        "n_steps": len(masks), "n_replicated": len(pairs), "measured_step_s": measured_s,
        "groups": list(batch.groups), "num_context_tokens": context.tolist(), "num_shared_context_tokens": shared.tolist(),
        "shapley_s": fit["shapley_s"], "half_s": (fit["ci_high_s"] - fit["ci_low_s"]) / 2, "cov_s2": fit["cov_s2"],
        "residual_dof": fit["residual_dof"], "shares_s": by_method,
        "permutation_half_s": projected_permutation_half_s({"size": n}, masks, fit, cost, confidence=confidence), "sharing_rule_shares_s": shares,
        "additivity": additivity, "replicate_pairs": pairs,
    }
    if record["exact"] and len(reps) == full:
        times = np.array([[float(np.median(_times(journal, batch, 0, s, repeat))), float(np.median(reps[s]))] for s in range(1, full + 1)])
        w = shapley_matrix(n)
        exact = w @ times.mean(axis=1)
        resid = times - times.mean(axis=1, keepdims=True)
        sigma2 = float(np.sum(resid**2) / (times.size - times.shape[0]))
        record.update(exact_shapley_s=exact, exact_var_s2=sigma2 / times.shape[1] * np.sum(w**2, axis=1), times=times,
                      pure_error_var=sigma2)
        assert np.allclose(exact, exact_shapley(np.concatenate([[0.0], times.mean(axis=1)])))
    return record


CROSSFIT_FOLDS = 4
"""Folds of request sets for pricing a journal's sharing rules with its engine's own terms (`crossfitted_models`)."""


class CoalitionStep(NamedTuple):
    """One measured step of a coalition (`coalition_steps`): its batch, batch-round, members (batch positions), their
    recorded contexts and shared tokens, their effective contexts, and the measurement."""

    batch: SampledBatchSpec
    batch_round: int
    members: np.ndarray
    context: np.ndarray
    shared: np.ndarray
    effective: np.ndarray
    measurement: Measurement


def coalition_steps(batches, journal, indices, repeat: int = 1, *, disturbed: bool = False) -> Iterator[CoalitionStep]:
    """The measured steps of the batches whose index is in ``indices`` (round 0, the first ``repeat`` of each
    coalition; those the interference guard kept flagged only with ``disturbed``), in measuring order. A step's
    effective context splits each prefix group's recorded shared tokens among its readers in the step
    (`grouped_effective_context`)."""
    for b in batches:
        if b.index not in indices:
            continue
        groups = np.asarray(b.groups)
        for k, chunk in enumerate(b.chunks(0)):
            for s in chunk:
                for m in journal.get(b, 0, s)[:repeat]:
                    if m.interference and not disturbed:
                        continue
                    idx = np.asarray(members(s, b.size))
                    context = np.asarray(m.num_context_tokens, dtype=np.float64)
                    shared = np.asarray(m.num_shared_context_tokens or np.zeros(idx.size), dtype=np.float64)
                    yield CoalitionStep(b, k, idx, context, shared, grouped_effective_context(context, shared, groups[idx]), m)


def coalition_steps_trace(batches, journal, indices, repeat: int = 1, *, disturbed: bool = False) -> StepTrace:
    """`coalition_steps` as a format-2 step trace with one run per request set (``set-<index>``), so
    `StepLatencyModel.fit` learns from them and `group_k_fold` splits them by request set."""
    cols: dict[str, list] = {k: [] for k in ("run_id", "step_id", "step_latency_s", "request_id", "tenant", "num_new_tokens",
                                             "num_context_tokens", "phase", "num_shared_context_tokens", "effective_context_tokens")}
    for step, c in enumerate(coalition_steps(batches, journal, indices, repeat, disturbed=disturbed), start=1):
        b, idx = c.batch, c.members
        cols["run_id"] += [f"set-{b.index}"] * idx.size
        cols["step_id"] += [step] * idx.size
        cols["step_latency_s"] += [c.measurement.step_latency_s] * idx.size
        cols["request_id"] += [f"{b.index}-{i}" for i in idx]
        cols["tenant"] += [""] * idx.size
        cols["num_new_tokens"] += np.asarray(b.num_new_tokens)[idx].tolist()
        cols["num_context_tokens"] += c.context.astype(np.int64).tolist()
        cols["phase"] += ["prefill" if p else "decode" for p in np.asarray(b.is_prefill, dtype=bool)[idx]]
        cols["num_shared_context_tokens"] += c.shared.astype(np.int64).tolist()
        cols["effective_context_tokens"] += c.effective.tolist()
    text = ("run_id", "request_id", "tenant", "phase")
    return build_trace({k: np.array(v, dtype=object if k in text else None) for k, v in cols.items()}, path="<coalition steps>")


def crossfitted_models(batches, journal, indices, *, n_folds: int = CROSSFIT_FOLDS) -> dict[int, StepLatencyModel]:
    """For each request set in ``indices``, the model llmvisor's fit (`StepLatencyModel` with its defaults) learns from
    the measured steps of the other folds' request sets (`group_k_fold` by request set): the run's own engine terms, none
    learned from a step of the batch they price. A sharing rule judged with them is judged apart from how well some
    other profile's model prices this engine (the shipped model's calibration is a separate question)."""
    trace = coalition_steps_trace(batches, journal, indices)
    runs = trace.run_id_per_step
    out: dict[int, StepLatencyModel] = {}
    for test in group_k_fold(runs, n_folds):
        model = StepLatencyModel().fit(trace[~test])
        out.update({int(run.removeprefix("set-")): model for run in set(runs[test].tolist())})
    return out


def shared_read_saving(model: StepLatencyModel) -> list[float]:
    """Per segment, the fraction of a decode context token's price that a second reader of its KV block does not pay:
    e ÷ (d2 + e), the once-per-step read over the whole (0: sharing saves nothing, 1: context is read once per step)."""
    out = []
    for segment in model.to_dict()["segments"]:
        coef = segment["coef_s"]
        per_token = coef["decode_context_tokens"] + coef.get("effective_context_tokens", 0.0)
        out.append(coef.get("effective_context_tokens", 0.0) / per_token if per_token > 0 else 0.0)
    return out


def engine_priced(batches, journal, records: list[dict], model, *, n_folds: int = CROSSFIT_FOLDS,
                  models: dict[int, StepLatencyModel] | None = None) -> tuple[list[dict], dict]:
    """``records`` (priced with ``model``) with every sharing rule's shares priced again by their request set's
    cross-fitted model (`crossfitted_models`, or ``models`` where the caller fitted them already), and how: the folds'
    models (boundary, shared-read saving) beside ``model``'s."""
    kept = [r for r in records if not r.get("interference_flagged")]
    if models is None:
        models = crossfitted_models(batches, journal, {r["index"] for r in kept}, n_folds=n_folds)
    by_index = {b.index: b for b in batches}
    priced = []
    for r in records:
        if r.get("interference_flagged"):
            priced.append(r)
            continue
        batch = by_index[r["index"]]
        shares = sharing_rule_shares(models[r["index"]], np.asarray(batch.num_new_tokens, dtype=np.float64), np.asarray(r["num_context_tokens"]),
                                     np.asarray(batch.is_prefill, dtype=bool), r["measured_step_s"],
                                     np.asarray(r["num_shared_context_tokens"]), r["groups"])
        priced.append(r | {"sharing_rule_shares_s": shares})
    folds = {id(m): m for m in models.values()}
    how = {"how": f"each request set's sharing rules priced by the model llmvisor's fit learns from the other request sets' "
                  f"measured steps ({n_folds} folds by request set, none priced by a fit that saw its steps)",
           "n_folds": len(folds),
           "folds": [{"n_request_sets": sum(1 for x in models.values() if x is m), "boundary_new_tokens": m.to_dict()["boundary_new_tokens"],
                      "shared_read_saving": shared_read_saving(m)} for m in folds.values()],
           "model_shared_read_saving": shared_read_saving(model)}
    return priced, how


def sharing_own_terms(batches, journal, records: list[dict], model, *, n_folds: int = CROSSFIT_FOLDS) -> dict | None:
    """The sharing check (`sharing_check`) with each request set's rules priced by the run's own terms
    (`engine_priced`), and how they were priced: what `validate` reports beside the check priced with ``model``. None
    without mixed-sharing batches from two request sets or more; where the steps are too few to fit, the reason."""
    kept = [r for r in records if not r.get("interference_flagged")]
    if len({r["index"] for r in kept}) < 2 or not any(r["kind"] == "mixed_sharing_decode" for r in kept):
        return None
    try:
        priced, how = engine_priced(batches, journal, kept, model, n_folds=n_folds)
    except LlmvisorError as error:
        return {"pricing": None, "not_fitted": str(error)}
    return {"pricing": how, **sharing_check(priced)}  # as `coalition_summary`: batches the guard kept flagged judge nothing


def sharing_rule_shares(model, new, context, is_prefill, measured_s: float, shared, groups) -> dict[str, np.ndarray]:
    """The ``shapley`` rule's shares of the whole batch's step under each sharing rule (`SHARING_RULES`; only the
    landed one where nothing is shared)."""
    shared = np.asarray(shared, dtype=np.float64)
    rules = SHARING_RULES if shared.any() else (LANDED_SHARING_RULE,)
    return {rule: model_shares(model, new, context, is_prefill, measured_s,
                               sharing_effective_context(rule, context, shared, groups) if shared.any() else None)[Method.SHAPLEY]
            for rule in rules}


def pooled_class_bias(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], *, confidence: float = 0.95) -> dict | None:
    """Σ shares / Σ values − 1 over the requests of one class in several batches, each row (shares, values, their
    covariance, the class's mask); the interval by the delta method on the values' covariance (batches independent)."""
    billed = truth = var = 0.0
    n = 0
    for share, value, cov, mask in rows:
        if not mask.any():
            continue
        billed += float(share[mask].sum())
        truth += float(value[mask].sum())
        var += float(cov[np.ix_(mask, mask)].sum())
        n += int(mask.sum())
    if not n or not truth > 0:
        return None
    ratio = billed / truth
    se = ratio / truth * math.sqrt(max(var, 0.0))
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    return {"bias": ratio - 1, "ci95": [ratio - 1 - z * se, ratio - 1 + z * se], "n": n, "n_batches": len(rows)}


def bias_verdict(entry: dict | None, limit: float = CLASS_BIAS_MAX) -> str:
    """"met" when the interval lies within ±limit, "missed" when it lies wholly outside, else "undecidable"."""
    if entry is None:
        return "undecidable"
    low, high = entry["ci95"]
    if -limit <= low and high <= limit:
        return "met"
    if low > limit or high < -limit:
        return "missed"
    return "undecidable"


def sharing_check(records: list[dict]) -> dict:
    """Class bias of each sharing rule, shared readers against own contexts and per prefix-group size rank, within
    the mixed-sharing batches (exact ones against their exact values, serving-size ones against the regression's);
    a rule is flagged when a class's interval lies wholly outside ±3%."""
    out: dict = {}
    for label, chosen in (("exact", [r for r in records if r["kind"] == "mixed_sharing_decode" and "exact_shapley_s" in r]),
                          ("serving_size", [r for r in records if r["kind"] == "mixed_sharing_decode" and "exact_shapley_s" not in r])):
        if not chosen:
            continue
        entry: dict = {"n_batches": len(chosen), "sizes": sorted({r["size"] for r in chosen}), "rules": {}}
        for rule in SHARING_RULES:
            classes: dict[str, list] = {}
            group_sizes: dict[str, set[int]] = {}
            for r in chosen:
                groups = np.array(r["groups"])
                value = r.get("exact_shapley_s", r["shapley_s"])
                cov = np.diag(r["exact_var_s2"]) if "exact_var_s2" in r else r["cov_s2"]
                share = np.asarray(r["sharing_rule_shares_s"][rule])
                for name, mask in sharing_class_masks(groups, r["num_context_tokens"]).items():
                    classes.setdefault(name, []).append((share, value, cov, mask))
                    if name.endswith("_group"):
                        group_sizes.setdefault(name, set()).add(int(mask.sum()))
            biases = {name: pooled_class_bias(rows) for name, rows in classes.items() if any(m.any() for *_, m in rows)}
            verdicts = {name: bias_verdict(b) for name, b in biases.items()}
            entry["rules"][rule] = {
                "class_bias": biases, "verdict": verdicts,
                "group_sizes": {k: sorted(v) for k, v in group_sizes.items()},
                "flagged": any(v == "missed" for v in verdicts.values()),
            }
        out[label] = entry
    return out


def coalition_summary(records: list[dict], *, permutation_reference: dict | None = None, seed: int = 0, trials: int = 20,
                      confidence: float = 0.95) -> dict:
    """The summary a coalitions-design result carries (see the module's notes). ``permutation_reference``: per
    "size/kind", the median permutation half-width ÷ step × √steps measured on prefix-design batches (another
    journal), which scales to any number of steps."""
    flagged = [r for r in records if r["interference_flagged"]]
    records = [r for r in records if not r["interference_flagged"]]  # kept after every redo was disturbed: judged on nothing
    if not records:
        return {"batch_sizes": {"n_interference_flagged_excluded": len(flagged)}}
    serving = [r for r in records if not r["exact"]]
    exact = [r for r in records if "exact_shapley_s" in r]
    games = [{"batch": _Batch(r["size"]), "record": {"shapley_s": r["exact_shapley_s"], "measured_step_s": r["measured_step_s"]},
              "times": r["times"], "pure_error_var": r["pure_error_var"]} for r in exact]
    coverage = exact_coverage(games, trials=trials, seed=seed, variant="relative_weights", min_size=4,
                              coalition_counts={"2n+1": lambda n: 2 * n + 1, "4n+1": lambda n: 4 * n + 1}) if games else None
    over_share: dict[str, float] = {}
    decision: dict[str, dict] = {}
    for kind in sorted({r["kind"] for r in serving}):
        chosen = [r for r in serving if r["kind"] == kind]
        ratio = np.concatenate([r["half_s"] / r["shares_s"][Method.SHAPLEY.value] for r in chosen])
        over_share[kind] = float(np.median(ratio))
        errors = {m.value: np.concatenate([np.abs(r["shares_s"][m.value] - r["shapley_s"]) / np.abs(r["shapley_s"]) for r in chosen])
                  for m in METHODS}
        quantiles = {m: plain_quantiles(e, qs=(50, 90, 99)) for m, e in errors.items()}
        decidable = over_share[kind] <= HALFWIDTH_DECIDABLE_MAX
        p90 = quantiles[Method.SHAPLEY.value]["p90"]
        gain = quantiles[Method.TOKEN_COUNT.value]["p90"] / p90 if p90 > 0 else math.inf
        decision[kind] = {
            "n_batches": len(chosen), "sizes": sorted({r["size"] for r in chosen}),
            "relative_error_vs_estimate": quantiles,
            "goal_p90": ("met" if p90 <= GOAL["p90_max"] else "missed") if decidable else "undecidable",
            "goal_vs_token_count": ("met" if gain >= GOAL["p90_improvement_vs_token_count_min"] else "missed") if decidable else "undecidable",
            "p90_gain_vs_token_count": gain,
            "halfwidth_over_share_p50": over_share[kind],
        }
    by_size: dict[str, dict] = {}
    for size in sorted({r["size"] for r in serving}):
        for kind in sorted({r["kind"] for r in serving if r["size"] == size}):
            chosen = [r for r in serving if r["size"] == size and r["kind"] == kind]
            ratio = float(np.median(np.concatenate([r["half_s"] / r["shares_s"][Method.SHAPLEY.value] for r in chosen])))
            steps = float(np.median([r["n_steps"] for r in chosen]))
            # half-width ∝ 1/√(measured coalitions): the coalitions a batch like these needs for a median of 25%
            by_size.setdefault(str(size), {})[kind] = {
                "n_batches": len(chosen), "steps_per_batch_p50": steps, "halfwidth_over_share_p50": ratio,
                "steps_for_halfwidth_quarter": math.ceil(steps * (ratio / HALFWIDTH_DECIDABLE_MAX) ** 2)}
    ratios: dict[str, dict] = {}
    for size in sorted({r["size"] for r in serving}):
        if size < 32:
            continue
        chosen = [r for r in serving if r["size"] == size]
        reg = np.concatenate([r["half_s"] / r["measured_step_s"] for r in chosen])
        perm = np.concatenate([r["permutation_half_s"] / r["measured_step_s"] for r in chosen])
        steps = float(np.median([r["n_steps"] for r in chosen]))
        entry: dict = {"n_batches": len(chosen), "steps_per_batch_p50": steps,
                       "regression_halfwidth_over_step_p50": float(np.median(reg)),
                       "permutation_halfwidth_over_step_p50_projected": float(np.median(perm)),
                       "ratio": float(np.median(perm / reg)),
                       "how": "per request, the permutation estimate's half-width at the batch's own number of measured steps "
                       "(steps / n orders, a perfect latency model as control variate: each marginal the difference of two "
                       "measurements, noise from the batch's regression residual, normal quantile) ÷ the regression's measured one"}
        for kind in sorted({r["kind"] for r in chosen}):
            ref = (permutation_reference or {}).get(f"{size}/{kind}")
            if ref is None:
                continue
            reg_k = float(np.median(np.concatenate([r["half_s"] / r["measured_step_s"] for r in chosen if r["kind"] == kind])))
            perm_k = ref["halfwidth_over_step_times_sqrt_steps_p50"] / math.sqrt(steps)
            entry.setdefault("measured_permutation_reference", {})[kind] = {
                "permutation_halfwidth_over_step_at_equal_steps_p50": perm_k, "regression_halfwidth_over_step_p50": reg_k,
                "ratio": perm_k / reg_k, "source": ref["source"]}
        ratios[str(size)] = entry
    noise = replicate_noise_floor([p for r in serving for p in r["replicate_pairs"]], seed=seed)
    noise_by_kind = {kind: replicate_noise_floor([p for r in serving if r["kind"] == kind for p in r["replicate_pairs"]], seed=seed)
                     for kind in sorted({r["kind"] for r in serving})}
    additivity = [{"index": r["index"], "kind": r["kind"], "size": r["size"], "f": r["additivity"]["f"], "p_value": r["additivity"]["p_value"],
                   "rejected": r["additivity"]["rejected"], "noise_source": r["additivity"]["noise_source"],
                   "interaction_rms_fraction_of_step": r["additivity"]["interaction_rms"]}  # relative weights: already a fraction
                  for r in serving if r["additivity"] is not None]
    return {
        "estimator": {
            "exact_coverage_95": coverage["coverage_95"] if coverage else None,
            "exact": coverage,
            "halfwidth_ratio_vs_permutation": {s: e.get("ratio") for s, e in ratios.items()},
            "halfwidth_ratio_detail": ratios,
            "variant": "relative_weights_rounds",
        },
        "sampled": {"halfwidth_over_share_p50": over_share, "by_kind": decision, "by_size": by_size},
        "batch_sizes": {"max": max(r["size"] for r in records), "min": min(r["size"] for r in records),
                        "serving_size": sorted({r["size"] for r in serving}), "n_serving_size_batches": len(serving),
                        "n_exact_batches": len(exact), "n_interference_flagged_excluded": len(flagged),
                        "n_steps_used": sum(r["n_steps"] + r["n_replicated"] * (2 if r["exact"] else 1) for r in records),
                        "n_disturbed_steps_left_out": sum(r.get("n_disturbed_steps", 0) for r in records + flagged),
                        "interference_flagged_excluded": [{"index": r["index"], "kind": r["kind"], "size": r["size"]} for r in flagged]},
        "sharing": sharing_check(records),
        "additivity": {
            "per_batch": additivity,
            "rejected_fraction_5pct": float(np.mean([a["rejected"] for a in additivity])) if additivity else None,
            "misfit_over_noise": plain_quantiles([a["f"] for a in additivity if math.isfinite(a["f"])], qs=(50, 90)) if additivity else None,
        },
        "noise_floor": {"relative_per_measurement": noise, "by_kind": noise_by_kind},
        "shared_kinds": [str(k) for k in SHARED_KINDS],
    }


def projected_permutation_half_s(record: dict, masks: list[int], fit: dict, cost: np.ndarray, *, confidence: float = 0.95) -> np.ndarray:
    """The half-width permutation sampling would have at the batch's number of measured steps: k = steps / n orders,
    each request's marginal in an order the difference of two measurements, each with variance σ²·T̂² (σ² the
    regression's residual variance per unit weight 1/T̂²); with a perfect control variate only that noise is left, so
    var(φ̂_i) = 2σ²·mean(T̂²) / k (normal quantile: in permutation sampling's favour at so few orders)."""
    n = record["size"]
    k = max(1.0, len(masks) / n)
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    fitted2 = 1.0 / relative_weights(masks, cost, n)
    return np.full(n, z * math.sqrt(2 * fit["sigma2"] * float(np.mean(fitted2)) / k))


class _Batch:
    """The size `exact_coverage` reads from a batch."""

    def __init__(self, size: int):
        self.size = size


def permutation_reference(result: dict) -> dict:
    """From a prefixes-design result (the shipped ``validation.json``): per "size/kind", the median over requests of the
    permutation estimate's 95% half-width ÷ step × √(measured steps), which scales to any number of steps."""
    rows: dict[str, list[float]] = {}
    for r in result.get("sampled_batches", []):
        low, high = r["shapley_ci95_s"]
        kind = r["kind"].removeprefix("sampled_")
        for lo, hi in zip(low, high, strict=True):
            if lo is not None and hi is not None:
                rows.setdefault(f"{r['size']}/{kind}", []).append((hi - lo) / 2 / r["measured_step_s"] * math.sqrt(r["n_subsets_measured"]))
    return {k: {"halfwidth_over_step_times_sqrt_steps_p50": float(np.median(v)), "n_requests": len(v),
                "source": "prefix-design batches of the shipped validation.json (measured)"} for k, v in rows.items()}


def batch_record_json(record: dict) -> dict:
    """A coalitions-design batch's record as the result file keeps it (no covariance matrix, no raw times)."""
    keep = ("interference_flagged", "n_disturbed_steps", "index", "kind", "size", "source", "exact", "n_steps", "n_replicated", "measured_step_s", "groups", "num_context_tokens",
            "num_shared_context_tokens", "shapley_s", "half_s", "permutation_half_s", "shares_s", "exact_shapley_s")
    out = {k: record[k] for k in keep if k in record}
    if record.get("additivity"):
        out["additivity"] = {k: record["additivity"][k] for k in ("f", "p_value", "rejected", "noise_source", "interaction_rms")}
    return jsonable(out)


def jsonable(value):
    """numpy values as plain JSON ones (non-finite floats as None)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [jsonable(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def measurement_cost(journal: Journal, runs: list[dict]) -> dict:
    """Where a journal's measuring time went: the runs' wall time (engine start included) against the measured steps'
    own time and the canaries', the rest being engine starts, prefilling each batch's contexts, preparing held
    contexts again per chunk and the measuring loop itself; per batch-round (for rounds journaled with their timing)
    the preparation, the rounds' wall time and the guard's waits."""
    wall_s = float(sum(r.get("wall_s", 0.0) for r in runs))
    measured = [m for ms in journal.measurements.values() for m in ms]
    step_s = float(sum(m.step_latency_s for m in measured))
    canary_s = float(sum(journal.canary_s))
    n_steps = int(sum(r.get("measured_steps", 0) for r in runs))
    out = {
        "n_runs": len(runs), "wall_s": wall_s, "n_steps_measured": n_steps, "n_steps_in_journal": len(measured),
        "steps_per_wall_s": n_steps / wall_s if wall_s > 0 else None,
        "step_time_s": step_s, "canary_time_s": canary_s,
        "step_time_fraction": step_s / wall_s if wall_s > 0 else None,
        "other_fraction": max(0.0, 1 - (step_s + canary_s) / wall_s) if wall_s > 0 else None,
        "steps_per_step_s": len(measured) / step_s if step_s > 0 else None,
    }
    if journal.round_timing:
        timing = journal.round_timing
        out["rounds"] = {"n": len(timing), **{k: float(sum(t.get(k, 0.0) for t in timing))
                                               for k in ("prepare_s", "round_wall_s", "steps_s", "wait_after_s")}}
    return out
