"""docs/validation.md quotes the coalitions-design result (``validation-coalitions.json``, written by ``llmvisor validate
--design coalitions``) from the file, and its words about the goals match the file's verdicts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmvisor import shipped
from llmvisor.validation.coalitions import HALFWIDTH_DECIDABLE_MAX
from llmvisor.validation.report import coalitions_markdown_summary

REPO = Path(__file__).resolve().parents[1]
RESULT = shipped.result_path("validation-coalitions.json")


@pytest.fixture(scope="module")
def result() -> dict:
    return json.loads(RESULT.read_text(encoding="utf-8"))


def doc() -> str:
    return " ".join((REPO / "docs" / "validation.md").read_text(encoding="utf-8").split())


def test_validation_doc_holds_the_coalitions_tables_generated_from_the_shipped_result(result):
    assert " ".join(coalitions_markdown_summary(result).split()) in doc()


def test_the_shipped_result_carries_the_issue_keys_and_its_journal(result):
    summary = result["summary"]
    assert {"exact_coverage_95", "halfwidth_ratio_vs_permutation"} <= set(summary["estimator"])
    assert summary["sampled"]["halfwidth_over_share_p50"] and summary["batch_sizes"]["max"] >= 16
    assert RESULT.with_name("validation-coalitions.journal.jsonl.gz").is_file()
    assert result["settings"]["sampled"]["design"] == "coalitions" and result["settings"]["max_num_seqs"] == 64


GOAL_COVERAGE_MIN = 0.90
GOAL_PRECISION_RATIO_MIN = 3.0
GOAL_SERVING_SIZE_BATCHES_MIN = 60
"""Issue #21's goals for the coalitions design, as docs/validation.md states them ("What these figures settle")."""


def goal_verdicts(summary: dict) -> dict[str, str]:
    """Each goal's verdict as the shipped file decides it, keyed by the goal's bold name in the doc."""
    estimator, sampled, sizes = summary["estimator"], summary["sampled"], summary["batch_sizes"]
    ratios = [r for r in estimator["halfwidth_ratio_vs_permutation"].values() if r is not None]
    halfwidth = sampled["halfwidth_over_share_p50"]
    mixed_batches = sampled["by_kind"].get("mixed_sharing_decode", {}).get("n_batches", 0)
    met = {
        "Coverage": estimator["exact_coverage_95"] >= GOAL_COVERAGE_MIN,
        "Precision at equal steps": len(ratios) == 2 and min(ratios) >= GOAL_PRECISION_RATIO_MIN,
        "Half-width ÷ share": all(halfwidth.get(k, 1.0) <= HALFWIDTH_DECIDABLE_MAX for k in ("decode", "shared_prefix_decode")),
        "Batches": sizes["n_serving_size_batches"] >= GOAL_SERVING_SIZE_BATCHES_MIN and 64 in sizes["serving_size"]
        and mixed_batches > 0,
    }
    return {goal: "met" if ok else "missed" for goal, ok in met.items()}


def settle_bullets(text: str) -> dict[str, str]:
    """The doc's "What these figures settle" bullets: bold goal name -> the bullet's text after it."""
    section = text[text.index("What these figures settle") : text.index("## Limits")]
    return {m.group(1): m.group(2) for m in re.finditer(r"- \*\*([^*]+)\*\*:? (.*?)(?= - \*\*|$)", section)}


def test_the_docs_verdict_on_each_goal_is_the_files(result):
    """Each goal bullet says "met" or "missed" right after its goal, and that word is the file's verdict."""
    bullets = settle_bullets(doc())
    for goal, verdict in goal_verdicts(result["summary"]).items():
        said = re.match(r"\(goal [^)]*\): (met|missed)\b", bullets[goal])
        assert said, f"docs/validation.md's {goal!r} bullet names no verdict: {bullets[goal][:120]!r}"
        assert said.group(1) == verdict, f"{goal}: the doc says {said.group(1)}, validation-coalitions.json says {verdict}"
    ratios = result["summary"]["estimator"]["halfwidth_ratio_vs_permutation"]
    assert ("at least 3× narrower at 32 and 64 requests" in bullets["Precision at equal steps"]) == (
        goal_verdicts(result["summary"])["Precision at equal steps"] == "met" and set(ratios) == {"32", "64"}
    )


def test_the_docs_words_on_the_sharing_rules_follow_the_flags(result):
    """The Sharing bullet's sentence on each set of mixed-sharing batches names the rules the file flags there."""
    sentences = settle_bullets(doc())["Sharing"].split(". ")
    for batches, words in (("exact", "on the exact mixed-sharing batches"), ("serving_size", "on the serving-size mixed-sharing batches")):
        rules = result["summary"]["sharing"][batches]["rules"]
        planted, split = rules["whole_block_per_reader"]["flagged"], rules["split_among_readers"]["flagged"]
        sentence = next((s for s in sentences if words in s.lower()), None)
        assert sentence is not None, f"the Sharing bullet says nothing {words}"
        assert ("neither rule is flagged" in sentence) == (not planted and not split), sentence
        assert ("the planted rule is flagged" in sentence) == planted, sentence
        if planted:
            assert ("the split rule is not" in sentence) == (not split), sentence
    serving = result["summary"]["sharing"]["serving_size"]["rules"]
    quoted = "where the planted whole-block rule is flagged and the split rule is not"  # "What a bill inherits"
    assert (quoted in doc()) == (serving["whole_block_per_reader"]["flagged"] and not serving["split_among_readers"]["flagged"])
