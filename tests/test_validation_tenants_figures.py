"""docs/validation.md's per-tenant figures come from docs/results/validation-tenants.json, which `llmvisor validate
--tenant-batches` wrote from a real vLLM engine: the headline sentences are rebuilt from the JSON's `summary.tenants`
(`llmvisor.validation.tenants.headline_sentences`, what the command prints), the goal's verdict from its own
half-widths, and the result is re-analysed from its shipped journal by the documented command, without the engine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from llmvisor.validation.tenants import HALFWIDTH_GOAL, headline_sentences

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "docs" / "results" / "validation-tenants.json"


def doc() -> str:
    return " ".join((REPO / "docs" / "validation.md").read_text(encoding="utf-8").split())


def test_the_doc_quotes_the_per_tenant_headline_and_the_goal_follows_from_the_figures():
    result = json.loads(RESULT.read_text(encoding="utf-8"))
    tenants = result["summary"]["tenants"]
    text = doc()
    for sentence in headline_sentences(tenants):
        assert sentence in text, sentence
    goal = tenants["goal"]
    for size, block in tenants["by_size"].items():
        half = block["halfwidth_over_share"]["p50"]
        assert goal["by_size"][size]["met"] == (half <= HALFWIDTH_GOAL)
    assert goal["met"] == all(goal["by_size"][str(s)]["met"] for s in goal["sizes"])
    if "the goal is met at 32 and 64 requests" in text:
        assert goal["met"] and goal["sizes"] == [32, 64]
    assert f"{tenants['n_batches']} batches, {tenants['n_tenants']} tenants" in text
    additivity = tenants["tenant_additivity"]
    assert f"rejected at the 5% level in {100 * additivity['rejected_fraction_5pct']:.0f}% of the {additivity['n_batches']} batches" in text
    rules = tenants["sharing_tenant_by_rule"]
    if "the same bill under the landed rule, first reader pays and split by context length" in text:
        same = {rule: rules[rule]["p90"] for rule in ("split_among_readers", "first_reader_pays", "split_by_context_length")}
        assert len(set(same.values())) == 1
    interference = result["interference"]
    assert f"{interference['n_batch_rounds_discarded']} batch-rounds were discarded and measured again" in text
    runs = result["settings"]["measurement_runs"]
    assert interference["n_batch_rounds_discarded"] == sum(r["discarded_batch_rounds"] for r in runs)
    redos = {r["guard_max_redos"] for r in runs}
    assert len(redos) == 1 and f"at most {redos.pop()} redos per batch-round" in text
    steps, wall_s = sum(r["measured_steps"] for r in runs), sum(r["wall_s"] for r in runs)
    assert f"{steps:,} measured steps in {wall_s / 60:.0f} minutes" in text and f"Measured steps per second here ({steps / wall_s:.2f}" in text
    # the verdict's bullet
    def p90(size: str) -> str:
        err = tenants["by_size"][size]["relative_error"]["shapley"]
        return f"{100 * err['p90']:.1f}% [{100 * err['p90_ci95'][0]:.1f}%, {100 * err['p90_ci95'][1]:.1f}%]"

    assert (f"a tenant's bill is within {p90('32')} of its measured Shapley value (p90) in batches of 32 requests, {p90('64')} in "
            f"batches of 64 and {p90('16')} in batches of 16") in text
    # the words, from the figures
    by_size, by_role, by_phase = tenants["by_size"], tenants["by_role"], tenants["by_phase"]
    halves = {size: block["halfwidth_over_share"]["p50"] for size, block in by_size.items()}
    for half in halves.values():
        assert f"{100 * half:.1f}%" in text
    if "it took one (warm measuring" in text:
        assert 0.9 <= wall_s / 3600 <= 1.1
    if "and at 16 as well" in text:
        assert halves["16"] <= HALFWIDTH_GOAL
    if "a seventh to a fifth of bills lie outside" in text:
        assert all(1 / 7.5 <= 1 - block["bill_within_interval_fraction"] <= 1 / 4.5 for block in by_size.values())
    p90 = {role: block["relative_error"]["shapley"]["p90"] for role, block in by_role.items()}
    if "The light tenant carries most of the error" in text:
        assert max(p90, key=p90.get) == "light"
    if "the heavy tenant's bill is within a few percent" in text:
        assert p90["heavy"] < 0.05
    if "where token count is about as good" in text:
        prefill = by_phase["prefill"]["relative_error"]
        assert abs(prefill["shapley"]["p90"] - prefill["token_count"]["p90"]) < 0.03


def test_the_result_is_what_its_journal_gives(tmp_path):
    """The documented re-analysis (`--no-measure`) of the shipped journal writes the same per-tenant summary."""
    shutil.copy(RESULT, tmp_path / RESULT.name)
    journal = RESULT.with_name(RESULT.name.removesuffix(".json") + ".journal.jsonl.gz")
    shutil.copy(journal, tmp_path / journal.name)
    done = subprocess.run([sys.executable, "-m", "llmvisor.cli", "validate", "-o", str(tmp_path / RESULT.name), "--no-measure"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    again = json.loads((tmp_path / RESULT.name).read_text(encoding="utf-8"))
    shipped = json.loads(RESULT.read_text(encoding="utf-8"))
    assert again["summary"]["tenants"] == shipped["summary"]["tenants"]


def test_a_headline_of_too_few_tenants_shows_a_dash_for_what_it_cannot_estimate():
    """A small plan (the vLLM smoke test's) can leave a quantile or its interval undefined: the sentence says "–"."""
    block = {"n_tenants": 2, "n_batches": 1, "bill_within_interval_fraction": 0.5,
             "relative_error": {"shapley": {"p50": 0.04, "p50_ci95": None, "p90": None, "p90_ci95": [None, None]}},
             "halfwidth_over_share": {"p50": 0.1, "p50_ci95": [0.05, 0.2]}}
    assert headline_sentences({"by_size": {"16": block}}) == [
        "16 requests (2 tenants of 1 batches): a tenant's bill is within – of its measured Shapley value (p90; median 4.0%), "
        "median 95% half-width 10.0% [5.0%, 20.0%] of its share, 50.0% of bills inside the measured value's interval"]
