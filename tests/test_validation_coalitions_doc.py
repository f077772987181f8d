"""docs/validation.md quotes the coalitions-design result (``validation-coalitions.json``, written by ``llmvisor validate
--design coalitions``) from the file, and its words about the goals match the file's verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmvisor import shipped
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


def test_the_docs_words_on_the_goals_follow_the_verdicts(result):
    """A goal may be called met in the doc only where the file says met; "the planted rule is flagged" only if it is."""
    text = doc()
    summary = result["summary"]
    sharing = summary["sharing"].get("exact", {}).get("rules", {})
    flagged = bool(sharing) and sharing["whole_block_per_reader"]["flagged"]
    assert ("the planted whole-block rule is flagged" in text) == flagged
    ratios = [r for r in summary["estimator"]["halfwidth_ratio_vs_permutation"].values() if r is not None]
    assert ("at least 3× narrower at 32 and 64 requests" in text) == (len(ratios) == 2 and min(ratios) >= 3)
    decode = summary["sampled"]["halfwidth_over_share_p50"]
    settled = all(decode.get(k, 1.0) <= 0.25 for k in ("decode", "shared_prefix_decode"))
    assert ("decidable on decode and shared batches" in text) == settled
