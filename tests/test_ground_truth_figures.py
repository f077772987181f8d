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
    same = figures["estimator"]["permutation_vs_regression_same_steps"]["by_size_and_kind"]
    for size in ("16", "32"):
        assert all(same[f"{size}/{kind}"]["ratio"] < 3 for kind in ("decode", "shared_prefix_decode", "prefill"))
        assert same[f"{size}/mixed"]["ratio"] > 3
    words = (f"by {same['32/decode']['ratio']:.2f}× (decode), {same['32/shared_prefix_decode']['ratio']:.2f}× (shared-prefix decode) "
             f"and {same['32/prefill']['ratio']:.2f}× (prefill) at 32 requests, and by {same['16/decode']['ratio']:.2f}×, "
             f"{same['16/shared_prefix_decode']['ratio']:.2f}× and {same['16/prefill']['ratio']:.2f}× at 16")
    assert words in text and "below the 3× goal for every kind but one" in text
    assert f"{same['16/mixed']['ratio']:.2f}× and {same['32/mixed']['ratio']:.2f}×" in text
    prefixes = figures["estimator"]["coverage_exact_prefixes"]
    assert prefixes["pooled"]["ci95"][0] >= 0.9 and "its intervals still cover" in text
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


def _signed(x: float) -> str:
    return f"{'+' if x > 0 else '−' if x < 0 else ''}{abs(100 * x):.1f}%"


def _range(folds: list[dict]) -> str:
    return f"{_pct(min(min(f['shared_read_saving']) for f in folds))}–{_pct(max(max(f['shared_read_saving']) for f in folds))}"


def test_the_sharing_run_words_match_its_verdicts(figures):
    """The sharing run (pairs layout): what docs/validation.md and the README say of each rule, priced with the run's
    own terms and with the shipped model, is what the file says."""
    run = figures["sharing_run"]
    assert run["n_request_sets"] >= 30 and run["plan"]["sharing_layout"] == "pairs" and run["plan"]["sizes"] == [16, 32]
    rules = run["rules"]["rules"]
    text, readme = doc(), " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    # priced with the run's own terms: nothing flagged, the wrong rules within reach of the ±3% or below it
    assert not any(r["flagged"] for r in rules.values())
    short = rules["split_among_readers"]["class_bias"]["short_readers"]
    assert f"short reader is billed {_signed(short['bias'])} [{_signed(short['ci95'][0])}, {_signed(short['ci95'][1])}] off its measured value" in text
    assert "the landed rule is not flagged** (a document's" in text and "and no wrong rule is either" in text
    whole, first, context = rules["whole_block_per_reader"], rules["first_reader_pays"], rules["split_by_context_length"]
    assert (f"depart from the equal split by at most {_pct(whole['departure_from_landed'])} (whole block per reader), "
            f"{_pct(first['departure_from_landed'])} (first reader pays) and {_signed(context['departure_from_landed'])} "
            "(split by context length)") in text
    assert f"about {whole['batches_to_flag']:,} and {first['batches_to_flag']:,} such batches" in text
    assert context["below_tolerance"] and "the third is within the ±3%" in text
    saving = _range(run["pricing"]["folds"])
    shipped_saving = figures["sharing_rules_pricing"]["model_shared_read_saving"]
    assert max(max(f["shared_read_saving"]) for f in run["pricing"]["folds"]) < 0.5 < min(shipped_saving)
    assert f"saves only {saving} of a decode context token's price" in text and f"engine {saving}" in text
    assert f"saves {_pct(shipped_saving[0])} of its price where the sharing run's engine saves {saving}" in readme
    assert f"block saves {_pct(shipped_saving[0])} of its price, the sharing run's engine {saving}" in text
    assert f"says a second reader saves {_pct(shipped_saving[0])} ({_pct(shipped_saving[1])} above its boundary)" in text
    assert f"coalitions journal's engine does ({_range(figures['sharing_rules_pricing']['folds'])} by its folds)" in text
    assert min(min(f["shared_read_saving"]) for f in figures["sharing_rules_pricing"]["folds"]) > 0.5
    # priced with the shipped model: the landed rule flagged, as two wrong rules
    shipped = run["shipped_model"]["rules"]["rules"]
    landed = shipped["split_among_readers"]
    short = landed["class_bias"]["short_readers"]
    billed = f"billed {_pct(-short['bias'])} [{_pct(-short['ci95'][1])}, {_pct(-short['ci95'][0])}] below its measured value"
    assert landed["flagged"] and short["ci95"][1] < -0.03 and billed in text
    assert shipped["first_reader_pays"]["flagged"] and shipped["split_by_context_length"]["flagged"] and not shipped["whole_block_per_reader"]["flagged"]
    assert "as are the split by context length and the first reader paying" in text
    for layout in ("coalitions", "run"):
        part = figures["sharing_rules"]["serving_size"]["rules"] if layout == "coalitions" else rules
        assert not part["split_among_readers"]["flagged"]
    assert "the landed rule is flagged on that run" in readme and "two plausible wrong rules are" in readme
    before, after = run["shipped_model"]["own_context_controls"]["own_context_below_600"], run["own_context_controls"]["own_context_below_600"]
    assert abs(after["bias"]) < abs(before["bias"])
    assert (f"move from {_signed(before['bias'])} [{_signed(before['ci95'][0])}, {_signed(before['ci95'][1])}] (below 600 tokens) with "
            f"the shipped model to {_signed(after['bias'])} [{_signed(after['ci95'][0])}, {_signed(after['ci95'][1])}] with the run's own terms") in text
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
    # the sharing run's own result (re-analysed with `llmvisor validate -o ... --no-measure`) holds the same check
    result = json.loads((REPO / "docs" / "results" / "validation-sharing.json").read_text(encoding="utf-8"))
    own = result["summary"]["sharing_own_terms"]["serving_size"]["rules"]
    assert {rule: row["flagged"] for rule, row in own.items()} == {rule: row["flagged"] for rule, row in shipped["rules"]["rules"].items()}
    assert "at most 2 redos" in result["interference"]["rule"]
    for rule, row in shipped["shipped_model"]["rules"]["rules"].items():
        assert again["shipped_model"]["rules"]["rules"][rule]["flagged"] == row["flagged"]
    for fold, fold_again in zip(shipped["pricing"]["folds"], again["pricing"]["folds"], strict=True):
        assert fold_again["shared_read_saving"] == pytest.approx(fold["shared_read_saving"], rel=1e-4)
    for fold, fold_again in zip(shipped["reach"], again["reach"], strict=True):
        for rule, row in fold["rules"].items():
            assert fold_again["rules"][rule]["departure"] == pytest.approx(row["departure"], rel=1e-4)
            for size, departure in row["by_size"].items():
                assert fold_again["rules"][rule]["by_size"][size] == pytest.approx(departure, rel=1e-4)
            figures_only = ("departure", "by_size")
            assert {k: v for k, v in fold_again["rules"][rule].items() if k not in figures_only} == {k: v for k, v in row.items() if k not in figures_only}


def test_the_figures_recompute_from_the_shipped_journal(figures):
    from llmvisor import shipped
    from llmvisor.validation.estimator import exact_batch_games, load_validation
    from llmvisor.validation.groundtruth import coalition_records, permutation_vs_regression_same_steps

    prefix = load_validation()
    result = json.loads(shipped.result_path(shipped.VALIDATION_RESULT).read_text(encoding="utf-8"))
    same = permutation_vs_regression_same_steps(prefix, result, n_bootstrap=0)["by_size_and_kind"]
    for key, row in figures["estimator"]["permutation_vs_regression_same_steps"]["by_size_and_kind"].items():
        assert same[key]["ratio"] == pytest.approx(row["ratio"], rel=1e-4)
    # "no exactly solved batch is of that kind (they are all prefill or decode steps)"
    assert {str(g["batch"].phase) for g in exact_batch_games(prefix, int(prefix.settings["repeat"]))} == {"prefill", "decode"}

    records, _ = coalition_records()
    quarter = quarter_tenant_halfwidths(records, n_bootstrap=0, seed=figures["seed"])["quarter"]
    for size, row in figures["tenants_from_old_journal"]["quarter"].items():
        assert quarter[size]["halfwidth_over_share"]["p50"] == pytest.approx(row["halfwidth_over_share"]["p50"], rel=1e-4)
    plan = figures["tenant_run_plan"]
    again = tenant_run_plan(noise_fraction=plan["noise_fraction_of_step"], overhead=plan["overhead"], seed=figures["seed"])
    assert again["by_repeat"]["6"]["steps"] == plan["by_repeat"]["6"]["steps"]
    assert again["by_repeat"]["6"]["hours_now"] == pytest.approx(plan["by_repeat"]["6"]["hours_now"], rel=1e-4)


def test_the_reach_words_match_the_file(figures):
    """What docs/validation.md and the README say of how far each wrong rule can reach (`sharing_rule_reach`, priced
    with each fold's terms) is what the file says: the split by context length within a few points of the ±3% on the
    sharing run's terms, the other two far beyond it, and the split by context length beyond it on the coalitions
    journal's terms."""
    text, readme = doc(), " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    run, coalitions = figures["sharing_run"]["reach"], figures["sharing_rules_reach"]
    assert len(run) == len(figures["sharing_run"]["pricing"]["folds"]) and len(coalitions) == figures["sharing_rules_pricing"]["n_folds"]

    def most(folds, rule):
        return max((f["rules"][rule] for f in folds), key=lambda r: abs(r["departure"]))

    def least(folds, rule):
        return min((f["rules"][rule] for f in folds), key=lambda r: abs(r["departure"]))

    by_length = most(run, "split_by_context_length")
    assert 0.03 < abs(by_length["departure"]) < 0.06 and by_length["readers_per_document"] == 2 and by_length["size"] == 64
    assert f"the split by context length moves no class's bill by more than {_pct(abs(by_length['departure']))}** from the equal split" in text
    assert (f"(pairs of a {by_length['document_tokens']:,}-token document at {by_length['size']} requests, "
            f"{by_length['class'].replace('_', ' ')};") in text
    fitted = [str(size) for size in figures["sharing_run"]["plan"]["sizes"]]
    within = max(abs(f["rules"]["split_by_context_length"]["by_size"][size]) for f in run for size in fitted)
    assert fitted == ["16", "32"] and 0.03 < within <= abs(by_length["departure"])
    assert f"at most {_pct(within)} in batches of 16 and 32, the sizes its terms were fitted on, which 64 extrapolates" in text
    margin = abs(by_length["departure"]) - 0.03
    assert f"at most {100 * margin:.1f} points beyond the check's ±3%" in text and f"narrower than ±{100 * margin:.1f}%" in text
    measured = figures["sharing_run"]["rules"]["rules"]["split_by_context_length"]
    assert f"against ±{_pct((measured['ci95'][1] - measured['ci95'][0]) / 2)} on the sharing run's short readers" in text
    assert measured["deciding_class"] == "short_readers" and (measured["ci95"][1] - measured["ci95"][0]) / 2 > 3 * margin
    whole, first = most(run, "whole_block_per_reader"), most(run, "first_reader_pays")
    assert min(abs(whole["departure"]), abs(first["departure"])) > 3 * 0.03
    assert (f"reach {_pct(abs(whole['departure']))} (whole block per reader) and {_pct(abs(first['departure']))} (first reader pays) "
            f"with the same terms, in groups of {whole['readers_per_document']} and {first['readers_per_document']} readers") in text
    low, high = least(coalitions, "split_by_context_length"), most(coalitions, "split_by_context_length")
    assert abs(low["departure"]) > 3 * 0.03 and high["readers_per_document"] == 2
    assert f"reaches {_pct(abs(low['departure']))} to {_pct(abs(high['departure']))} (pairs at {high['size']} requests)" in text
    assert f"moves no class's bill more than {_pct(abs(by_length['departure']))} from the equal split on the sharing run's engine" in readme
    assert (f"no layout searched lets it move a class's bill more than {_pct(abs(by_length['departure']))} from the equal split "
            '("How far a wrong rule can reach")') in text
    # the searched layouts in the words are the function's
    from llmvisor.validation.groundtruth import REACH_DOCUMENT_SHARES, REACH_READERS_PER_DOCUMENT, REACH_SIZES

    assert (f"layouts of {', '.join(map(str, REACH_SIZES[:-1]))} and {REACH_SIZES[-1]} requests" in text
            and f"{REACH_READERS_PER_DOCUMENT[0]} to {REACH_READERS_PER_DOCUMENT[-1]} readers per document" in text
            and f"documents of {_pct(REACH_DOCUMENT_SHARES[0]).replace('.0', '')} to {_pct(REACH_DOCUMENT_SHARES[-1]).replace('.0', '')} of the longest context" in text)
