"""Does measured Shapley on a real engine agree with the LoRA rule (docs/attribution.md, "LoRA adapters")?

The rule decides what a base-model request pays for being batched with adapters: none of a step's per-adapter term
(l5 per distinct adapter) nor of the LoRA path's set-up (l8), both its adapter requests' alone, and A/(A+1) of its
own tokens' trip through the LoRA kernels (l9 per base-model token: vLLM runs them over every token of a step that
runs an adapter; A the step's adapter requests; `llmvisor.core.game`). The check measures two games that differ
only there, with the same "subject" base-model requests in both:

- the mixed game M: the subjects plus requests running adapters;
- the control game C: the subjects plus base-model stand-ins with the same contexts in place of the adapter requests.

Every subset of each game runs as one engine step, in rounds (each round measures every subset of both games once,
in random order). For each subject i, d_i = φ_i(M) − φ_i(C) (exact Shapley of the subset means): what being
batched with adapters instead of base-model requests adds to its measured share. Under the stated rule
d_i = l9·A/(A+1) (a decode token each; the latency model's shares, `rule_differences`, give it). Two wrong rules
are checked beside it (``RULES``): "wrong", each per-step adapter term (l5 per adapter, l8) split over all requests
of the step, d_i = (l5·adapters + l8)/|step| + l9·A/(A+1); and "base_pays_none", the LoRA path charged to the
adapter requests whole, d_i = 0 (the rule before the path was modelled). The statistic is D = Σ_i d_i over
the subjects, its 95% interval a percentile bootstrap over rounds (a round's two games resampled together, so slow
spells of the machine shared by both cancel in d). A rule's D inside the interval: "agrees within noise"; outside:
"flagged". When both rules' D lie inside, the measurement cannot tell them apart: "undecidable at this budget".

Differencing against the control game removes the latency model's own error in the base-model terms (the same in
both games), but not its error in the LoRA terms: a rule priced with a fitted l9 that is off for this batch is judged
off too. So the rules are also priced with the batch's own LoRA terms (`batch_lora_terms`: least squares of M − C
over the subsets that run an adapter), fitted on half the rounds and judged on the other half (`split_rounds`), so
no round both prices a rule and judges it: that verdict is about the rule alone.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from llmvisor.core.attribution import attribute_arrays
from llmvisor.core.features import LoraCoef, lora_slices
from llmvisor.core.game import segment_of
from llmvisor.core.model import StepLatencyModel
from llmvisor.validation.game import exact_shapley, members

AGREES = "agrees within noise"
FLAGGED = "flagged"
UNDECIDABLE = "undecidable at this budget"
CONFIDENCE = 0.95


RULES = ("stated", "wrong", "base_pays_none")
"""The rules checked (module docstring): the project's, and two wrong ones."""


def step_shares(model, contexts, names, ranks, *, rule: str) -> np.ndarray:
    """Each request's share (seconds) of one decode step (one token each over ``contexts``; request i runs adapter
    ``names[i]`` of rank ``ranks[i]``, "" and 0 for the base model, every adapter resident) under ``rule`` (one of
    ``RULES``): "stated" (the project's Shapley attribution with ``lora=``), "wrong" (the same, except the per-step
    adapter terms l5 and l8 split over every request of the step) or "base_pays_none" (the same, except the LoRA
    path's base-token term l9 charged whole to the adapter requests, in equal parts)."""
    n = len(contexts)
    p = np.ones(n)
    lora = lora_slices(np.array(list(names), dtype=object), ranks, np.array([0, n]), [frozenset()], [frozenset()], num_new_tokens=p)
    c = np.asarray(contexts, dtype=np.float64)
    shares = attribute_arrays(model, p, c, np.zeros(n, dtype=bool), np.array([0, n]), lora=lora).share_s
    coef = model.coef_[segment_of(model.boundary_, float(n))]  # the whole step's segment (one token per request)
    if rule == "stated":
        return shares
    if rule == "wrong":
        per_step = coef[LoraCoef.L5] * lora.adapter_share + coef[LoraCoef.L8] * lora.lora_step_share
        return shares - per_step + per_step.sum() / n
    if rule == "base_pays_none":
        path = coef[LoraCoef.L9] * lora.base_token_share
        return shares - path + path.sum() * lora.lora_step_share
    raise ValueError(f"rule {rule!r}: one of {', '.join(RULES)}")


def batch_lora_terms(mixed_means_s, control_means_s, names) -> dict:
    """The LoRA terms of one measured batch, from its games' subset means (index = bit mask of players, as
    `compare_rules` takes them; ``names`` the mixed game's adapter per player, "" the base model): nonnegative least
    squares of M(S) − C(S) over the subsets S that run an adapter on [1, adapter requests in S, base-model requests in
    S], that is l8 (the LoRA path's set-up), l3 + l5 (an adapter request's token work and its adapter's kernels: one
    request per adapter here, so the two cannot be told apart; both go to l3) and l9 (per base-model token). Returns the
    three coefficients and the fit's residual (root mean square, seconds)."""
    diff = np.asarray(mixed_means_s, dtype=np.float64) - np.asarray(control_means_s, dtype=np.float64)
    adapter = [bool(a) for a in names]
    rows, target = [], []
    for mask in range(1, diff.size):
        chosen = members(mask, len(adapter))
        n_adapter = sum(adapter[i] for i in chosen)
        if n_adapter:
            rows.append([1.0, float(n_adapter), float(len(chosen) - n_adapter)])
            target.append(diff[mask])
    a, b = np.array(rows), np.array(target)
    coef, _ = nnls(a, b)
    return {"lora_steps_s": float(coef[0]), "adapter_request_s": float(coef[1]), "lora_base_tokens_s": float(coef[2]),
            "residual_rms_s": float(np.sqrt(np.mean((a @ coef - b) ** 2))), "n_subsets": int(b.size)}


def with_batch_lora_terms(model, terms: dict):
    """A copy of ``model`` whose decode LoRA terms are a batch's (`batch_lora_terms`): l3 its per-adapter-request term,
    l4 and l5 0 (folded into l3), l8 and l9 its own."""
    coef = np.array(model.coef_, dtype=np.float64)
    coef[:, LoraCoef.L3] = terms["adapter_request_s"]
    coef[:, [LoraCoef.L4, LoraCoef.L5]] = 0.0
    coef[:, LoraCoef.L8] = terms["lora_steps_s"]
    coef[:, LoraCoef.L9] = terms["lora_base_tokens_s"]
    names = model.feature_names_
    return StepLatencyModel.from_coefficients([dict(zip(names, row)) for row in coef], model.boundary_)


def split_rounds(n_rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """Rounds that price the rules (odd-numbered: 1st, 3rd, ...) and rounds that judge them (the others): interleaved,
    so slow spells of the machine fall on both halves alike."""
    index = np.arange(n_rounds)
    return index[0::2], index[1::2]


def rule_differences(model, subjects: list[int], mixed: dict, control: dict) -> dict[str, np.ndarray]:
    """Per subject, each rule's φ_i(M) − φ_i(C): ``mixed`` and ``control`` give the games' ``contexts``, ``names``
    and ``ranks`` in player order (the subjects at the same positions ``subjects`` in both)."""
    return {rule: step_shares(model, **mixed, rule=rule)[subjects] - step_shares(model, **control, rule=rule)[subjects]
            for rule in RULES}


def _shapley_of_means(costs_s: np.ndarray) -> np.ndarray:
    """Exact Shapley of a game from rounds of subset costs, shape (rounds, 2**n), column 0 (empty subset) zero."""
    return exact_shapley(np.nanmean(costs_s, axis=0))


def compare_rules(mixed_s: np.ndarray, control_s: np.ndarray, subjects: list[int], predicted: dict[str, np.ndarray], *,
                  n_resamples: int = 2000, seed: int = 0) -> dict:
    """The check of the module docstring from measured rounds: ``mixed_s`` and ``control_s`` of shape (rounds, 2**n)
    (round r of both measured together; NaN: a subset not measured in that round), the subjects' player indices, and
    each rule's predicted d per subject (`rule_differences`). Returns measured φ of both games with intervals, d per
    subject and D with intervals, each rule's D and verdict, and the overall verdict."""
    mixed_s = np.asarray(mixed_s, dtype=np.float64)
    control_s = np.asarray(control_s, dtype=np.float64)
    if mixed_s.shape != control_s.shape or mixed_s.ndim != 2 or mixed_s.shape[0] < 2:
        raise ValueError("mixed and control: the same shape (rounds >= 2, 2**n subsets)")
    rounds = mixed_s.shape[0]
    rng = np.random.default_rng(seed)
    lo_q, hi_q = 100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2

    def stats(idx):
        phi_m, phi_c = _shapley_of_means(mixed_s[idx]), _shapley_of_means(control_s[idx])
        return phi_m, phi_c

    phi_m, phi_c = stats(np.arange(rounds))
    boot_m, boot_c = zip(*(stats(rng.integers(0, rounds, rounds)) for _ in range(n_resamples)), strict=True)
    boot_m, boot_c = np.array(boot_m), np.array(boot_c)
    boot_d = boot_m[:, subjects] - boot_c[:, subjects]
    boot_total = boot_d.sum(axis=1)
    d = phi_m[subjects] - phi_c[subjects]
    total = float(d.sum())
    interval = [float(np.percentile(boot_total, lo_q)), float(np.percentile(boot_total, hi_q))]
    rules = {}
    for rule, values in predicted.items():
        predicted_total = float(np.sum(values))
        inside = interval[0] <= predicted_total <= interval[1]
        rules[rule] = {"d_s": [float(v) for v in values], "D_s": predicted_total, "inside_interval": bool(inside),
                       "verdict": AGREES if inside else FLAGGED}
    if all(r["inside_interval"] for r in rules.values()):
        for r in rules.values():
            r["verdict"] = UNDECIDABLE
    verdict = {rule: r["verdict"] for rule, r in rules.items()}
    return {
        "rounds": rounds,
        "confidence": CONFIDENCE,
        "bootstrap": {"method": "percentile, rounds resampled with replacement (both games of a round together)",
                      "n_resamples": n_resamples, "seed": seed},
        "phi_mixed_s": phi_m.tolist(),
        "phi_mixed_ci95_s": np.percentile(boot_m, [lo_q, hi_q], axis=0).T.tolist(),
        "phi_control_s": phi_c.tolist(),
        "phi_control_ci95_s": np.percentile(boot_c, [lo_q, hi_q], axis=0).T.tolist(),
        "subjects": list(subjects),
        "d_s": d.tolist(),
        "d_ci95_s": np.percentile(boot_d, [lo_q, hi_q], axis=0).T.tolist(),
        "D_s": total,
        "D_ci95_s": interval,
        "D_half_width_s": (interval[1] - interval[0]) / 2,
        "rules": rules,
        "verdict": verdict,
    }


def noise_floor(costs_s: np.ndarray) -> dict:
    """Per subset, the repeats' relative standard deviation (sd / mean over rounds): its median and p90 over the
    game's nonempty subsets."""
    costs_s = np.asarray(costs_s, dtype=np.float64)[:, 1:]
    rel = np.nanstd(costs_s, axis=0, ddof=1) / np.nanmean(costs_s, axis=0)
    return {"rel_sd_p50": float(np.median(rel)), "rel_sd_p90": float(np.percentile(rel, 90)),
            "definition": "per nonempty subset, sd over rounds / mean over rounds of its step time; median and p90 over subsets"}
