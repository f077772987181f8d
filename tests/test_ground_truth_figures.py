"""docs/results/ground-truth.json (written by scripts/ground-truth-figures.py from the shipped journals) and the
section of docs/validation.md that quotes it: the tables are generated from the file, the words match its verdicts,
and the figures cheap to recompute are recomputed from the journal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmvisor.validation.groundtruth import markdown_summary, quarter_tenant_halfwidths, tenant_run_plan

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "docs" / "results" / "ground-truth.json"


@pytest.fixture(scope="module")
def figures() -> dict:
    return json.loads(FIGURES.read_text(encoding="utf-8"))


def doc() -> str:
    return " ".join((REPO / "docs" / "validation.md").read_text(encoding="utf-8").split())


def test_the_doc_holds_the_tables_generated_from_the_file(figures):
    assert " ".join(markdown_summary(figures).split()) in doc()


def test_the_words_match_the_verdicts(figures):
    text = doc()
    quarter = figures["tenants_from_old_journal"]["quarter"]
    assert quarter["32"]["halfwidth_over_share"]["p50"] <= 0.25 and quarter["64"]["halfwidth_over_share"]["p50"] <= 0.25
    assert quarter["16"]["halfwidth_over_share"]["p50"] > 0.25
    assert "under 25% of the share at 32 and 64 requests and over it at 16" in text
    ratios = figures["estimator"]["permutation_vs_regression_measured"]["by_size_and_kind"]
    assert all(ratios[k]["ratio"] < 3 for k in ("32/decode", "32/shared_prefix_decode"))
    assert all(0.7 < ratios[k]["ratio"] < 1.5 for k in ("16/decode", "16/shared_prefix_decode"))
    assert "below the 3× goal" in text and "about as precise" in text
    coverage = figures["estimator"]["coverage_exact"]
    assert coverage["all"]["n_batches"] >= 10 and coverage["all"]["pooled"]["coverage_95"] >= 0.9
    assert coverage["mixed_sharing"]["n_batches"] == 3 and coverage["mixed_sharing"]["by_coalitions"]["all"]["coverage_95"] < 0.9
    assert "only 3 are mixed-sharing batches" in text
    bias = figures["estimator"]["additive_projection_bias"]
    long = bias["prefix_journal"]["by_class"]["long"]
    assert 0 < long["ci95"][0] and long["bias"] < 0.01
    shared = bias["mixed_sharing"]["by_class"]["shared_readers"]["ci95"]
    assert shared[1] - shared[0] > 0.05 and "not bounded by these data" in text
    rules = figures["sharing_rules"]["serving_size"]["rules"]
    assert not rules["split_among_readers"]["flagged"]
    assert rules["whole_block_per_reader"]["flagged"] and rules["first_reader_pays"]["flagged"]
    assert not rules["split_by_context_length"]["flagged"] and rules["split_by_context_length"]["below_tolerance"]
    assert not any(r["flagged"] for r in figures["sharing_rules"]["exact"]["rules"].values())
    assert "the whole-block and first-reader rules are, and the split by context length is not" in text
    plan = figures["tenant_run_plan"]["by_repeat"]["6"]
    assert max(plan["halfwidth_over_share_p50"].values()) < 0.25 and "--tenant-repeat 6" in text
    assert figures["n_mixed_sharing_request_sets"] < 30


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def test_the_sharing_run_words_match_its_verdicts(figures):
    """The sharing run (pairs layout): what docs/validation.md and the README say of each rule is what the file says."""
    run = figures["sharing_run"]
    assert run["n_request_sets"] >= 30 and run["plan"]["sharing_layout"] == "pairs" and run["plan"]["sizes"] == [16, 32]
    rules = run["rules"]["rules"]
    text, readme = doc(), " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    landed = rules["split_among_readers"]
    short = landed["class_bias"]["short_readers"]
    billed = f"a document's short reader is billed {_pct(-short['bias'])} [{_pct(-short['ci95'][1])}, {_pct(-short['ci95'][0])}] below its measured value"
    assert landed["flagged"] and short["ci95"][1] < -0.03 and billed in text and billed in readme
    assert "The landed rule is flagged too" in text and "flags the landed equal split as well" in text
    assert rules["first_reader_pays"]["flagged"] and rules["split_by_context_length"]["flagged"]
    assert not rules["whole_block_per_reader"]["flagged"] and "each reader paying the whole block is not" in text
    context, first = rules["split_by_context_length"], rules["first_reader_pays"]
    assert context["deciding_class"] == "short_readers" and f"short readers billed {_pct(-context['bias'])} under their value" in text
    assert context["class_bias"]["long_readers"]["bias"] > 0.03  # "long readers over it"
    assert first["deciding_class"] == "later_readers" and f"later readers billed {_pct(-first['bias'])} under" in text
    # the serving-size groups layout flags the whole block: "the groups layout above flags it"
    assert figures["sharing_rules"]["serving_size"]["rules"]["whole_block_per_reader"]["flagged"]
    controls = run["own_context_controls"]
    below, above = controls["own_context_below_600"], controls["own_context_from_2000"]
    assert below["bias"] < 0 < above["bias"] and below["ci95"][0] < 0 < below["ci95"][1]  # same sign, undecided
    def signed(x: float) -> str:
        return f"{'+' if x > 0 else '−' if x < 0 else ''}{abs(100 * x):.1f}%"

    for label, b in (("below 600 tokens", below), ("from 2,000 tokens", above)):
        assert f"{label} {signed(b['bias'])} [{signed(b['ci95'][0])}, {signed(b['ci95'][1])}]" in text, label
    cost = run["measurement_cost"]
    assert f"{cost['steps_per_wall_s']:.1f} measured steps per second over that run, {cost['steps_per_wall_s'] / 4.5:.1f}× the 4.5" in text
    assert cost["steps_per_wall_s"] < 3 * 4.5 and "short of the 3× goal" in text
    rounds = cost["rounds"]
    for part, seconds in (("the guard's waits took", rounds["wait_after_s"]), ("the measured steps", cost["step_time_s"]),
                          ("preparing each batch's contexts", rounds["prepare_s"]), ("the canaries", cost["canary_time_s"])):
        assert f"{part} {_pct(seconds / cost['wall_s'])}" in text, part
    assert f"{cost['steps_per_step_s']:.1f} per second of step time" in text
    assert f"in one piece of {cost['wall_s'] / 60:.0f} minutes" in text


def test_the_sharing_run_recomputes_from_its_journal(figures):
    from llmvisor.validation.groundtruth import sharing_run_figures

    again = sharing_run_figures(REPO / "docs" / "results" / "validation-sharing.json")
    shipped = figures["sharing_run"]
    assert again["n_request_sets"] == shipped["n_request_sets"]
    for rule, row in shipped["rules"]["rules"].items():
        assert again["rules"]["rules"][rule]["flagged"] == row["flagged"]
        for name, b in row["class_bias"].items():
            if b:
                assert again["rules"]["rules"][rule]["class_bias"][name]["bias"] == pytest.approx(b["bias"], rel=1e-4, abs=1e-6)
    for name, b in shipped["own_context_controls"].items():
        assert again["own_context_controls"][name]["bias"] == pytest.approx(b["bias"], rel=1e-4)


def test_the_figures_recompute_from_the_shipped_journal(figures):
    from llmvisor.validation.groundtruth import coalition_records

    records, _ = coalition_records()
    quarter = quarter_tenant_halfwidths(records, n_bootstrap=0, seed=figures["seed"])["quarter"]
    for size, row in figures["tenants_from_old_journal"]["quarter"].items():
        assert quarter[size]["halfwidth_over_share"]["p50"] == pytest.approx(row["halfwidth_over_share"]["p50"], rel=1e-4)
    plan = figures["tenant_run_plan"]
    again = tenant_run_plan(noise_fraction=plan["noise_fraction_of_step"], overhead=plan["overhead"], seed=figures["seed"])
    assert again["by_repeat"]["6"]["steps"] == plan["by_repeat"]["6"]["steps"]
    assert again["by_repeat"]["6"]["hours_now"] == pytest.approx(plan["by_repeat"]["6"]["hours_now"], rel=1e-4)
