"""docs/attribution.md's measured-Shapley check of the LoRA rule comes from docs/results/lora-shapley.json, which
`python scripts/measure-lora-shapley.py` wrote from a real vLLM engine: the measured Shapley values are rebuilt from
the JSON's subset means, the rules' predictions from the fitted model of docs/results/lora.json, the verdicts from the
JSON's own interval by the stated rule, and every sentence the doc quotes from the JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from llmvisor.core.model import StepLatencyModel
from llmvisor.validation.game import exact_shapley
from llmvisor.validation.lora import AGREES, FLAGGED, UNDECIDABLE, rule_differences, step_shares

REPO = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("measure_lora_shapley", REPO / "scripts" / "measure-lora-shapley.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, json.loads((REPO / "docs" / "results" / "lora-shapley.json").read_text(encoding="utf-8"))


def test_the_json_is_a_mixed_adapter_measurement_and_its_verdicts_follow_from_its_figures():
    _, result = load()
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
    fitted = json.loads((REPO / "docs" / "results" / "lora.json").read_text(encoding="utf-8"))
    model = StepLatencyModel.from_coefficients([{k: v[0] for k, v in fitted["coef_s"].items()}])
    strip = ("players",)
    predicted = rule_differences(model, subjects, {k: v for k, v in mixed.items() if k not in strip},
                                 {k: v for k, v in control.items() if k not in strip})
    for game, spec in (("mixed", mixed), ("control", control)):  # each rule's shares of the whole batch
        for rule in ("stated", "wrong"):
            expected = step_shares(model, contexts=spec["contexts"], names=spec["names"], ranks=spec["ranks"], rule=rule)
            assert np.allclose(result["rule_shares_s"][game][rule], expected, rtol=1e-12)
    lo, hi = check["D_ci95_s"]
    inside = {}
    for rule in ("stated", "wrong"):
        assert np.allclose(check["rules"][rule]["d_s"], predicted[rule], atol=1e-12)
        inside[rule] = lo <= float(np.sum(predicted[rule])) <= hi
    for rule in ("stated", "wrong"):
        expected = UNDECIDABLE if all(inside.values()) else AGREES if inside[rule] else FLAGGED
        assert check["verdict"][rule] == check["rules"][rule]["verdict"] == expected


def test_the_doc_quotes_the_json():
    script, result = load()
    doc = " ".join((REPO / "docs" / "attribution.md").read_text(encoding="utf-8").split())
    for sentence in script.doc_sentences(result):
        assert sentence in doc, sentence
    check = result["check"]
    contexts = result["games"]["mixed"]["contexts"]
    assert f"three base-model \"subjects\" (contexts {', '.join(str(contexts[i]) for i in check['subjects'])})" in doc
    if "each interval above 0" in doc:
        assert all(low > 0 for low, _ in check["d_ci95_s"])
    if "more than even the wrong rule charges them" in doc:
        assert check["D_ci95_s"][0] > check["rules"]["wrong"]["D_s"]
    if "the stated rule is contradicted by the measurement" in doc:
        assert check["verdict"]["stated"] == "flagged"
    mixed, control = result["subset_mean_s"]["mixed"], result["subset_mean_s"]["control"]
    if "the adapter's extra time grows with the base-model requests in the step" in doc:
        assert mixed[15] - control[15] > mixed[8] - control[8]
