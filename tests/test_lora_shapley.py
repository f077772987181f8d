"""The LoRA rule check (`llmvisor.validation.lora`) on constructed games with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from llmvisor.core.features import FEATURE_NAMES_LORA
from llmvisor.core.model import StepLatencyModel
from llmvisor.validation.game import subset_masks
from llmvisor.validation.lora import AGREES, FLAGGED, UNDECIDABLE, compare_rules, noise_floor, rule_differences, step_shares

N = 5
SUBJECTS = [0, 1, 2]
ADAPTERS = [3, 4]
L5_S = 0.002
MIXED = {"contexts": [64, 128, 192, 96, 160], "names": ["", "", "", "a", "b"], "ranks": [0, 0, 0, 8, 64]}
CONTROL = {"contexts": [64, 128, 192, 96, 160], "names": [""] * 5, "ranks": [0] * 5}


def lora_model() -> StepLatencyModel:
    return StepLatencyModel.from_coefficients([{**dict.fromkeys(FEATURE_NAMES_LORA, 0.0), "intercept": 0.005, "decode_requests": 0.001, "effective_context_tokens": 1e-6,
                                                "decode_lora_tokens": 0.0008, "lora_adapters": L5_S}])


def own_s(i: int) -> float:
    return 0.001 + 1e-6 * MIXED["contexts"][i]


def game_rounds(*, mixed: bool, rounds: int, noise_s: float, base_pays_s: float = 0.0, seed: int = 0) -> np.ndarray:
    """Rounds of a game's subset costs: intercept + own terms (+ per-token adapter work and l5 per adapter present in
    the mixed game), and, with ``base_pays_s``, that much more for every subject in a subset that runs an adapter."""
    rng = np.random.default_rng(seed)
    cost = np.zeros(1 << N)
    for mask in subset_masks(N)[1:]:
        players = [i for i in range(N) if mask >> i & 1]
        value = 0.005 + sum(own_s(i) for i in players)
        adapters = [i for i in players if i in ADAPTERS] if mixed else []
        value += (0.0008 + L5_S) * len(adapters)
        if adapters:
            value += base_pays_s * sum(1 for i in players if i in SUBJECTS)
        cost[mask] = value
    noisy = cost + rng.normal(0.0, noise_s, (rounds, 1 << N))
    noisy[:, 0] = 0.0
    return noisy


def test_rules_shares_from_the_model():
    model = lora_model()
    predicted = rule_differences(model, SUBJECTS, MIXED, CONTROL)
    assert np.allclose(predicted["stated"], 0.0, atol=1e-15)
    assert np.allclose(predicted["wrong"], L5_S * 2 / N)
    for rule in ("stated", "wrong"):  # both split the same step: they sum to the model's prediction
        assert step_shares(model, **MIXED, rule=rule).sum() == pytest.approx(step_shares(model, **MIXED, rule="stated").sum())
    stated = step_shares(model, **MIXED, rule="stated")
    assert stated[3] - stated[0] > L5_S  # an adapter request pays its l5 (and its token work); a subject none


def test_base_requests_that_pay_nothing_pass_the_stated_rule_and_flag_the_wrong_one():
    predicted = rule_differences(lora_model(), SUBJECTS, MIXED, CONTROL)
    result = compare_rules(game_rounds(mixed=True, rounds=40, noise_s=2e-4, seed=1), game_rounds(mixed=False, rounds=40, noise_s=2e-4, seed=2),
                           SUBJECTS, predicted, n_resamples=400)
    assert result["verdict"] == {"stated": AGREES, "wrong": FLAGGED}
    assert result["D_ci95_s"][0] <= 0.0 <= result["D_ci95_s"][1]
    assert np.allclose(result["phi_mixed_s"][3] - result["phi_control_s"][3], 0.0008 + L5_S, atol=3e-4)


def test_base_requests_that_do_pay_adapter_cost_flag_the_stated_rule():
    predicted = rule_differences(lora_model(), SUBJECTS, MIXED, CONTROL)
    result = compare_rules(game_rounds(mixed=True, rounds=40, noise_s=2e-4, base_pays_s=0.003, seed=1),
                           game_rounds(mixed=False, rounds=40, noise_s=2e-4, seed=2), SUBJECTS, predicted, n_resamples=400)
    assert result["verdict"]["stated"] == FLAGGED
    assert result["D_ci95_s"][0] > float(np.sum(predicted["wrong"]))  # they pay more than even the wrong rule says


def test_too_much_noise_is_undecidable():
    predicted = rule_differences(lora_model(), SUBJECTS, MIXED, CONTROL)
    result = compare_rules(game_rounds(mixed=True, rounds=4, noise_s=0.02, seed=3), game_rounds(mixed=False, rounds=4, noise_s=0.02, seed=4),
                           SUBJECTS, predicted, n_resamples=400)
    assert result["verdict"] == {"stated": UNDECIDABLE, "wrong": UNDECIDABLE}


def test_noise_floor_and_shapes():
    rounds = game_rounds(mixed=False, rounds=30, noise_s=1e-3, seed=5)
    floor = noise_floor(rounds)
    assert 0.0 < floor["rel_sd_p50"] <= floor["rel_sd_p90"] < 0.2
    with pytest.raises(ValueError):
        compare_rules(rounds, rounds[:, :8], SUBJECTS, {})
