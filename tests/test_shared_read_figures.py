"""docs/results/shared-read.json (written by `python scripts/measure-shared-read.py` on the real engine, its two journals
gzipped beside it) and what docs/validation.md says of it: the figures quoted are the file's, the saving recomputes from
the journals, and the words ("at most", "well below" the coalitions journal's) follow the intervals."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from llmvisor.validation.measurement import Journal
from test_shared_read import script

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "docs" / "results" / "shared-read.json"


@pytest.fixture(scope="module")
def result() -> dict:
    return json.loads(RESULT.read_text(encoding="utf-8"))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def test_the_doc_quotes_the_file_and_its_words_follow_the_intervals(result):
    text = " ".join((REPO / "docs" / "validation.md").read_text(encoding="utf-8").split())
    cold, warm = (result["methods"][m]["with_chunk_offsets"] for m in ("cold", "warm"))
    for name, fit in (("cold", cold), ("warm", warm)):
        assert f"{name} {_pct(fit['shared_read_saving'])} [{_pct(fit['ci95'][0])}, {_pct(fit['ci95'][1])}]" in text, name
    plan = result["plan"]
    assert plan["sharing_layout"] == "pairs" and f"{plan['batches']} batches of {plan['sizes'][0]}" in text
    assert f"{plan['coalitions_per_request']:g} coalitions per request" in text
    figures = json.loads((REPO / "docs" / "results" / "ground-truth.json").read_text(encoding="utf-8"))
    coalitions_min = min(min(f["shared_read_saving"]) for f in figures["sharing_rules_pricing"]["folds"])
    # "measured cold, a second reader in this layout saves at most <upper>, well below the coalitions journal's"
    coalitions_max = max(max(f["shared_read_saving"]) for f in figures["sharing_rules_pricing"]["folds"])
    assert cold["ci95"][1] < coalitions_min / 2 and f"saves at most {_pct(cold['ci95'][1])}" in text
    assert f"well below the coalitions journal's {_pct(coalitions_min)}–{_pct(coalitions_max)}" in text
    assert "not the measuring method" in text and result["engine"]["max_num_seqs"] == 32


def test_the_saving_recomputes_from_the_shipped_journals(result, tmp_path):
    module = script()
    plan_settings = result["plan"]
    plan = module.draw_plan(batches=plan_settings["batches"], sizes=tuple(plan_settings["sizes"]),
                            coalitions_per_request=plan_settings["coalitions_per_request"],
                            max_num_seqs=result["engine"]["max_num_seqs"], seed=plan_settings["seed"])
    for method, name in result["journals"].items():
        plain = tmp_path / name
        with gzip.open(RESULT.with_name(name + ".gz"), "rb") as source, open(plain, "wb") as target:
            shutil.copyfileobj(source, target)
        again = module.offsets_fit(plan, Journal(plain), {b.index for b in plan}, n_bootstrap=0, seed=0)
        shipped = result["methods"][method]["with_chunk_offsets"]
        assert again["n_steps"] == shipped["n_steps"]
        assert again["shared_read_saving"] == pytest.approx(shipped["shared_read_saving"], abs=1e-6)
