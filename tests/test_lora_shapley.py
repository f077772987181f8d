"""The LoRA rule check (`llmvisor.validation.lora`) on constructed games with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from llmvisor.core.features import FEATURE_NAMES_LORA, LoraCoef
from llmvisor.core.model import StepLatencyModel
from llmvisor.validation.game import subset_masks
from llmvisor.validation.lora import (
    AGREES,
    FLAGGED,
    RULES,
    UNDECIDABLE,
    batch_lora_terms,
    compare_rules,
    noise_floor,
    rule_differences,
    split_rounds,
    step_shares,
    with_batch_lora_terms,
)

N = 5
SUBJECTS = [0, 1, 2]
ADAPTERS = [3, 4]
L5_S = 0.002
L8_S = 0.003
L9_S = 0.0006
MIXED = {"contexts": [64, 128, 192, 96, 160], "names": ["", "", "", "a", "b"], "ranks": [0, 0, 0, 8, 64]}
CONTROL = {"contexts": [64, 128, 192, 96, 160], "names": [""] * 5, "ranks": [0] * 5}


def lora_model() -> StepLatencyModel:
    return StepLatencyModel.from_coefficients([{**dict.fromkeys(FEATURE_NAMES_LORA, 0.0), "intercept": 0.005, "decode_requests": 0.001, "effective_context_tokens": 1e-6,
                                                "decode_lora_tokens": 0.0008, "lora_adapters": L5_S, "lora_steps": L8_S,
                                                "lora_base_tokens": L9_S}])


def own_s(i: int) -> float:
    return 0.001 + 1e-6 * MIXED["contexts"][i]


def game_rounds(*, mixed: bool, rounds: int, noise_s: float, base_pays_s: float = L9_S, path_s: float = L8_S, seed: int = 0) -> np.ndarray:
    """Rounds of a game's subset costs: intercept + own terms (+ per-token adapter work and l5 per adapter present in
    the mixed game), and in a subset that runs an adapter the LoRA path: ``path_s`` once and ``base_pays_s`` more for
    every subject (the engine the model describes by default; 0 and 0: an engine whose LoRA kernels skip base tokens)."""
    rng = np.random.default_rng(seed)
    cost = np.zeros(1 << N)
    for mask in subset_masks(N)[1:]:
        players = [i for i in range(N) if mask >> i & 1]
        value = 0.005 + sum(own_s(i) for i in players)
        adapters = [i for i in players if i in ADAPTERS] if mixed else []
        value += (0.0008 + L5_S) * len(adapters)
        if adapters:
            value += path_s + base_pays_s * sum(1 for i in players if i in SUBJECTS)
        cost[mask] = value
    noisy = cost + rng.normal(0.0, noise_s, (rounds, 1 << N))
    noisy[:, 0] = 0.0
    return noisy


def test_rules_shares_from_the_model():
    model = lora_model()
    predicted = rule_differences(model, SUBJECTS, MIXED, CONTROL)
    # two adapter requests (A = 2): a subject pays A/(A+1) of its token's trip through the LoRA kernels
    assert np.allclose(predicted["stated"], L9_S * 2 / 3)
    assert np.allclose(predicted["wrong"], (L5_S * 2 + L8_S) / N + L9_S * 2 / 3)
    assert np.allclose(predicted["base_pays_none"], 0.0, atol=1e-15)
    for rule in RULES:  # all split the same step: they sum to the model's prediction
        assert step_shares(model, **MIXED, rule=rule).sum() == pytest.approx(step_shares(model, **MIXED, rule="stated").sum())
    stated = step_shares(model, **MIXED, rule="stated")
    assert stated[3] - stated[0] > L5_S + L8_S / 2  # an adapter request pays its l5, half the path's set-up (and its work)
    with pytest.raises(ValueError, match="stated, wrong, base_pays_none"):
        step_shares(model, **MIXED, rule="first_reader")


def test_an_engine_as_the_model_says_agrees_with_the_stated_rule_and_flags_both_wrong_ones():
    predicted = rule_differences(lora_model(), SUBJECTS, MIXED, CONTROL)
    result = compare_rules(game_rounds(mixed=True, rounds=40, noise_s=2e-4, seed=1), game_rounds(mixed=False, rounds=40, noise_s=2e-4, seed=2),
                           SUBJECTS, predicted, n_resamples=400)
    assert result["verdict"] == {"stated": AGREES, "wrong": FLAGGED, "base_pays_none": FLAGGED}
    assert result["D_ci95_s"][0] <= 3 * L9_S * 2 / 3 <= result["D_ci95_s"][1]
    # an adapter request's measured extra: its token work, l5, and of the path half the set-up and a 1/(A(A+1)) share
    # of the subjects' three tokens
    assert np.allclose(result["phi_mixed_s"][3] - result["phi_control_s"][3], 0.0008 + L5_S + L8_S / 2 + 3 * L9_S / 6, atol=3e-4)


def test_base_requests_that_pay_nothing_flag_the_stated_rule_and_agree_with_the_rule_that_says_so():
    predicted = rule_differences(lora_model(), SUBJECTS, MIXED, CONTROL)
    result = compare_rules(game_rounds(mixed=True, rounds=40, noise_s=2e-4, base_pays_s=0.0, seed=1),
                           game_rounds(mixed=False, rounds=40, noise_s=2e-4, seed=2), SUBJECTS, predicted, n_resamples=400)
    assert result["verdict"] == {"stated": FLAGGED, "wrong": FLAGGED, "base_pays_none": AGREES}
    assert result["D_ci95_s"][0] <= 0.0 <= result["D_ci95_s"][1]


def test_base_requests_that_pay_more_than_their_tokens_trip_flag_the_stated_rule():
    predicted = rule_differences(lora_model(), SUBJECTS, MIXED, CONTROL)
    result = compare_rules(game_rounds(mixed=True, rounds=40, noise_s=2e-4, base_pays_s=0.006, seed=1),
                           game_rounds(mixed=False, rounds=40, noise_s=2e-4, seed=2), SUBJECTS, predicted, n_resamples=400)
    assert result["verdict"]["stated"] == FLAGGED
    assert result["D_ci95_s"][0] > float(np.sum(predicted["wrong"]))  # they pay more than even the wrong rule says


def test_too_much_noise_is_undecidable():
    predicted = rule_differences(lora_model(), SUBJECTS, MIXED, CONTROL)
    result = compare_rules(game_rounds(mixed=True, rounds=4, noise_s=0.02, seed=3), game_rounds(mixed=False, rounds=4, noise_s=0.02, seed=4),
                           SUBJECTS, predicted, n_resamples=400)
    assert result["verdict"] == dict.fromkeys(RULES, UNDECIDABLE)


def test_noise_floor_and_shapes():
    rounds = game_rounds(mixed=False, rounds=30, noise_s=1e-3, seed=5)
    floor = noise_floor(rounds)
    assert 0.0 < floor["rel_sd_p50"] <= floor["rel_sd_p90"] < 0.2
    with pytest.raises(ValueError):
        compare_rules(rounds, rounds[:, :8], SUBJECTS, {})


def test_the_batchs_own_lora_terms_are_recovered_and_a_rule_priced_with_them_is_judged_on_other_rounds():
    mixed = game_rounds(mixed=True, rounds=40, noise_s=2e-4, seed=1)
    control = game_rounds(mixed=False, rounds=40, noise_s=2e-4, seed=2)
    fit, judge = split_rounds(40)
    assert set(fit) | set(judge) == set(range(40)) and not set(fit) & set(judge)
    terms = batch_lora_terms(mixed[fit].mean(axis=0), control[fit].mean(axis=0), MIXED["names"])
    assert terms["n_subsets"] == 24  # the subsets with an adapter request: 32 - 8
    assert terms["lora_steps_s"] == pytest.approx(L8_S, abs=3e-4)
    assert terms["adapter_request_s"] == pytest.approx(0.0008 + L5_S, abs=3e-4)
    assert terms["lora_base_tokens_s"] == pytest.approx(L9_S, abs=1e-4)
    # a model whose LoRA terms are off (l9 twice the engine's) flags the stated rule; the batch's own terms do not
    off = StepLatencyModel.from_coefficients([{**dict(zip(lora_model().feature_names_, lora_model().coef_[0])), "lora_base_tokens": 2 * L9_S}])
    assert compare_rules(mixed[judge], control[judge], SUBJECTS, rule_differences(off, SUBJECTS, MIXED, CONTROL),
                         n_resamples=400)["verdict"]["stated"] == FLAGGED
    batch = with_batch_lora_terms(off, terms)
    assert batch.coef_[0, LoraCoef.L9] == terms["lora_base_tokens_s"] and batch.coef_[0, LoraCoef.L5] == 0.0
    result = compare_rules(mixed[judge], control[judge], SUBJECTS, rule_differences(batch, SUBJECTS, MIXED, CONTROL), n_resamples=400)
    assert result["verdict"] == {"stated": AGREES, "wrong": FLAGGED, "base_pays_none": FLAGGED}
