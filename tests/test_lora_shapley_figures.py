"""docs/attribution.md's measured-Shapley check of the LoRA rule comes from docs/results/lora-shapley.json, which
`python scripts/measure-lora-shapley.py` wrote from a real vLLM engine: the measured Shapley values are rebuilt from
the JSON's subset means, the rules' predictions from the fitted model of docs/results/lora.json, the verdicts from the
JSON's own interval by the stated rule, and every sentence the doc quotes from the JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from llmvisor.validation.game import exact_shapley
from llmvisor.validation.lora import (
    AGREES,
    FLAGGED,
    RULES,
    UNDECIDABLE,
    batch_lora_terms,
    rule_differences,
    split_rounds,
    step_shares,
    with_batch_lora_terms,
)

REPO = Path(__file__).resolve().parents[1]


FILES = ("lora-shapley.json", "lora-shapley-repeat.json")
"""The shipped run and its repeat (same script and model, half an hour later)."""


def load(name: str = FILES[0]):
    spec = importlib.util.spec_from_file_location("measure_lora_shapley", REPO / "scripts" / "measure-lora-shapley.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, json.loads((REPO / "docs" / "results" / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", FILES)
def test_the_json_is_a_mixed_adapter_measurement_and_its_verdicts_follow_from_its_figures(name):
    script, result = load(name)
    assert result["command"].startswith("python scripts/measure-lora-shapley.py")
    ranks = [a["rank"] for a in result["adapters"]]
    assert len(set(ranks)) == 2
    assert result["engine"]["enable_lora"] and result["engine"]["max_loras"] >= len(ranks)  # no load inside a measured step
    mixed, control = result["games"]["mixed"], result["games"]["control"]
    assert mixed["contexts"] == control["contexts"] and sorted(r for r in mixed["ranks"] if r) == sorted(ranks)
    assert all(r == 0 for r in control["ranks"])
    check = result["check"]
    subjects = check["subjects"]
    assert all(mixed["ranks"][i] == 0 for i in subjects)
    for game in ("mixed", "control"):  # measured Shapley = exact Shapley of the recorded subset means
        assert np.allclose(exact_shapley(np.array(result["subset_mean_s"][game])), check[f"phi_{game}_s"], rtol=1e-9, atol=1e-12)
    d = np.array(check["phi_mixed_s"])[subjects] - np.array(check["phi_control_s"])[subjects]
    assert np.allclose(d, check["d_s"]) and np.isclose(d.sum(), check["D_s"])
    model = script.fitted_model(REPO / "docs" / "results" / "lora.json")[0]
    strip = ("players",)
    predicted = rule_differences(model, subjects, {k: v for k, v in mixed.items() if k not in strip},
                                 {k: v for k, v in control.items() if k not in strip})
    assert set(check["rules"]) == set(RULES)
    for game, spec in (("mixed", mixed), ("control", control)):  # each rule's shares of the whole batch
        for rule in RULES:
            expected = step_shares(model, contexts=spec["contexts"], names=spec["names"], ranks=spec["ranks"], rule=rule)
            assert np.allclose(result["rule_shares_s"][game][rule], expected, rtol=1e-12)
    assert_verdicts_follow(check, predicted)


def assert_verdicts_follow(check: dict, predicted: dict) -> None:
    """Each rule's D is its predicted d summed, and its verdict what the check's own interval says of it."""
    lo, hi = check["D_ci95_s"]
    inside = {}
    for rule in RULES:
        assert np.allclose(check["rules"][rule]["d_s"], predicted[rule], atol=1e-12)
        inside[rule] = lo <= float(np.sum(predicted[rule])) <= hi
    for rule in RULES:
        expected = UNDECIDABLE if all(inside.values()) else AGREES if inside[rule] else FLAGGED
        assert check["verdict"][rule] == check["rules"][rule]["verdict"] == expected


@pytest.mark.parametrize("name", FILES)
def test_the_batch_terms_check_is_priced_on_some_rounds_and_judged_on_the_others(name):
    """Rebuilt from the kept rounds: the batch's LoRA terms from the odd rounds' subset means, the judged interval from
    the even rounds', the verdicts from that interval; and the rounds are the ones the subset means came from."""
    script, result = load(name)
    mixed_s, control_s = script.read_rounds(REPO / "docs" / "results" / result["rounds_file"])
    assert mixed_s.shape == control_s.shape == (result["check"]["rounds"], 32)
    assert np.allclose(np.nanmean(mixed_s, axis=0), result["subset_mean_s"]["mixed"], atol=1e-7)
    assert np.allclose(np.nanmean(control_s, axis=0), result["subset_mean_s"]["control"], atol=1e-7)
    games = {g: {k: v for k, v in spec.items() if k != "players"} for g, spec in result["games"].items()}
    fit, judge = split_rounds(mixed_s.shape[0])
    terms = batch_lora_terms(np.nanmean(mixed_s[fit], axis=0), np.nanmean(control_s[fit], axis=0), games["mixed"]["names"])
    batch = result["batch_terms_check"]
    assert batch["terms"] == pytest.approx(terms, rel=1e-6, abs=1e-9)
    assert batch["check"]["rounds"] == judge.size
    model = with_batch_lora_terms(script.fitted_model(REPO / "docs" / "results" / "lora.json")[0], batch["terms"])
    assert_verdicts_follow(batch["check"], rule_differences(model, batch["check"]["subjects"], games["mixed"], games["control"]))


def test_the_doc_quotes_the_json():
    script, result = load()
    doc = " ".join((REPO / "docs" / "attribution.md").read_text(encoding="utf-8").split())
    for sentence in script.doc_sentences(result):
        assert sentence in doc, sentence
    check = result["check"]
    contexts = result["games"]["mixed"]["contexts"]
    assert f"three base-model \"subjects\" (contexts {', '.join(str(contexts[i]) for i in check['subjects'])})" in doc
    if "the interval is above 0" in doc:
        assert check["D_ci95_s"][0] > 0
    if "far less than the wrong rule charges them" in doc:
        assert check["rules"]["wrong"]["D_s"] > check["D_ci95_s"][1]
    model = result["model"]  # the terms that priced the games: the segment the whole batch falls in
    assert f"where this batch and all its subsets fall: l8 = {script.ms(model['l8_lora_steps_s'])}, l9 = {script.ms(model['l9_lora_base_tokens_s'])} per base-model token)" in doc
    assert model == script.model_record(script.fitted_model(REPO / "docs" / "results" / "lora.json")[0],
                                        json.loads((REPO / "docs" / "results" / "lora.json").read_text(encoding="utf-8")), 5)
    _, repeat = load(FILES[1])
    quoted = script.doc_sentences(repeat)
    for k in (3, 5, 6, 7, 14, 16, 17, 18, 19, 20):
        assert quoted[k] in doc, quoted[k]
    # the words, each checked against the figures it rests on
    assert "and as much as the profiled terms say" in doc and check["verdict"]["stated"] == AGREES
    assert "in both runs the stated rule agrees within noise, priced with the profiled model's terms and with the batch's own" in doc
    assert all(c["verdict"]["stated"] == AGREES for r in (result, repeat) for c in (r["check"], r["batch_terms_check"]["check"]))
    assert "both wrong rules are flagged in every check" in doc
    assert all(c["verdict"][rule] == FLAGGED for r in (result, repeat) for c in (r["check"], r["batch_terms_check"]["check"])
               for rule in ("wrong", "base_pays_none"))
    low, stated = repeat["check"]["D_ci95_s"][0], repeat["check"]["rules"]["stated"]["D_s"]
    assert f"lower end ({script.ms(low)}) is just below the stated rule's D ({script.ms(stated)})" in doc
    assert 0 < stated - low < 0.05 * stated
    # "run on the same machine": the files can say only as much as the CPU's name and threads
    fitted = json.loads((REPO / "docs" / "results" / "lora.json").read_text(encoding="utf-8"))
    assert "run on the same machine right after the profile above" in doc
    assert all(r["engine"]["hardware"] == fitted["engine"]["hardware"] for r in (result, repeat))
    if "each interval above 0" in doc:
        assert all(low > 0 for low, _ in check["d_ci95_s"])
    if "more than even the wrong rule charges them" in doc:
        assert check["D_ci95_s"][0] > check["rules"]["wrong"]["D_s"]
    if "the stated rule is contradicted by the measurement" in doc:
        assert check["verdict"]["stated"] == "flagged"
    mixed, control = result["subset_mean_s"]["mixed"], result["subset_mean_s"]["control"]
    if "the adapter's extra time grows with the base-model requests in the step" in doc:
        assert mixed[15] - control[15] > mixed[8] - control[8]
