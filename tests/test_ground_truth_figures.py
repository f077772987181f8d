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
    assert figures["n_mixed_sharing_request_sets"] < 30 <= figures["sharing_run_plan"]["n_batches"]


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
