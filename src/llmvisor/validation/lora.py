"""Does measured Shapley on a real engine agree with the LoRA rule (docs/attribution.md, "LoRA adapters")?

The rule decides one thing a measurement can see: a step's per-adapter term (l5 per distinct adapter) is paid by
that adapter's requests only, so a base-model request pays none of it. The check measures two games that differ
only there, with the same "subject" base-model requests in both:

- the mixed game M: the subjects plus requests running adapters;
- the control game C: the subjects plus base-model stand-ins with the same contexts in place of the adapter requests.

Every subset of each game runs as one engine step, in rounds (each round measures every subset of both games once,
in random order). For each subject i, d_i = φ_i(M) − φ_i(C) (exact Shapley of the subset means): what being
batched with adapters instead of base-model requests adds to its measured share. Under the stated rule d_i = 0
(the latency model's shares, `rule_differences`, give exactly that); under the wrong rule (each per-adapter term
split over all requests of the step) d_i = l5 · (adapters in the step) / |step|. The statistic is D = Σ_i d_i over
the subjects, its 95% interval a percentile bootstrap over rounds (a round's two games resampled together, so slow
spells of the machine shared by both cancel in d). A rule's D inside the interval: "agrees within noise"; outside:
"flagged". When both rules' D lie inside, the measurement cannot tell them apart: "undecidable at this budget".

Differencing against the control game removes the latency model's own error in the base-model terms (the same in
both games), so the verdict is about the rule, not about the fit.
"""

from __future__ import annotations

import numpy as np

from llmvisor.core.attribution import attribute_arrays
from llmvisor.core.features import LoraCoef, LoraSlices
from llmvisor.validation.game import exact_shapley

AGREES = "agrees within noise"
FLAGGED = "flagged"
UNDECIDABLE = "undecidable at this budget"
CONFIDENCE = 0.95


def decode_step_lora(ranks) -> LoraSlices:
    """``LoraSlices`` of one decode step whose slice i runs an adapter of rank ``ranks[i]`` (0: the base model), every
    adapter resident (no loads); the adapter shares are set by the caller, who knows which slices share an adapter."""
    ranks = np.asarray(ranks, dtype=np.float64)
    return LoraSlices(ranks, np.zeros_like(ranks), np.zeros_like(ranks), np.zeros_like(ranks))


def step_shares(model, contexts, names, ranks, *, rule: str) -> np.ndarray:
    """Each request's share (seconds) of one decode step (one token each over ``contexts``; request i runs adapter
    ``names[i]`` of rank ``ranks[i]``, "" and 0 for the base model) under ``rule``: "stated" (the project's Shapley
    attribution with ``lora=``) or "wrong" (the same, except each per-adapter term l5 split over every request of
    the step instead of that adapter's requests)."""
    n = len(contexts)
    names = list(names)
    counts = {a: names.count(a) for a in set(names) if a}
    share = np.array([1.0 / counts[a] if a else 0.0 for a in names])
    lora = decode_step_lora(ranks)._replace(adapter_share=share)
    p = np.ones(n)
    c = np.asarray(contexts, dtype=np.float64)
    shares = attribute_arrays(model, p, c, np.zeros(n, dtype=bool), np.array([0, n]), lora=lora).share_s
    if rule == "stated":
        return shares
    if rule != "wrong":
        raise ValueError(f"rule {rule!r}: 'stated' or 'wrong'")
    l5 = float(model.coef_[0][LoraCoef.L5])
    return shares - l5 * share + l5 * len(counts) / n


def rule_differences(model, subjects: list[int], mixed: dict, control: dict) -> dict[str, np.ndarray]:
    """Per subject, each rule's φ_i(M) − φ_i(C): ``mixed`` and ``control`` give the games' ``contexts``, ``names``
    and ``ranks`` in player order (the subjects at the same positions ``subjects`` in both)."""
    return {rule: step_shares(model, **mixed, rule=rule)[subjects] - step_shares(model, **control, rule=rule)[subjects]
            for rule in ("stated", "wrong")}


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
