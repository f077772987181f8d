"""The README's main job on the shipped vLLM traces: it runs, judges held out, conserves time, writes a report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmvisor.core.trace import read_trace
from llmvisor.shipped import HELD_OUT_TRACES, TRAIN_TRACE, trace_path


def test_shipped_traces_are_real_vllm_recordings_with_distinct_runs():
    runs = set()
    for name in (TRAIN_TRACE, *HELD_OUT_TRACES):
        trace = read_trace(trace_path(name))
        assert trace.n_steps > 100
        assert set(trace.extra["engine"].tolist()) == {"vllm"}
        assert not runs & set(trace.run_ids)
        runs |= set(trace.run_ids)
    sweep = read_trace(trace_path(TRAIN_TRACE))
    assert {"p50", "p90", "p99"} <= set(sweep.metadata["noise_floor"])
    assert sweep.is_prefill_per_step.any() and (~sweep.is_prefill_per_step).any()
    mixed = [sweep.is_prefill[a:b].any() and not sweep.is_prefill[a:b].all() for a, b in zip(sweep.step_offsets[:-1], sweep.step_offsets[1:])]
    assert any(mixed), "the sweep must hold mixed (chunked-prefill + decode) steps"


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "llmvisor.cli", "demo", "-o", str(tmp_path / "report"), "--json", "--bootstrap", "50"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    evaluation = summary["evaluation"]
    assert set(evaluation["test_runs"]).isdisjoint(evaluation["train_runs"])
    assert set(evaluation["models"]) == {"llmvisor", "paper_ols", "token_count", "random_forest"}
    for phase in ("prefill", "decode"):
        assert evaluation["models"]["llmvisor"][phase]["n_steps"] > 0
        assert evaluation["improvement"][phase]["p90"] > 0
    attribution = summary["attribution"]
    assert sum(attribution["by_rule"]["shapley"].values()) == pytest.approx(attribution["total_measured_s"], rel=1e-9)
    assert sum(attribution["by_rule"]["paper"].values()) < attribution["total_measured_s"]
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count("data:image/png;base64,") >= 3
    assert (tmp_path / "report" / "model.json").is_file()


def test_demo_report_links_its_json_and_explains_the_step_counts(tmp_path):
    """Piped (not a terminal, COLUMNS unset: rich would assume 80 columns), every table row stays on one line."""
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    result = subprocess.run(
        [sys.executable, "-m", "llmvisor.cli", "demo", "-o", str(tmp_path / "report"), "--bootstrap", "20"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("│")]
    assert rows, result.stdout
    # a wrapped cell continues on a line whose first cell (model or tenant) is blank
    assert [line for line in rows if line.split("│")[1].strip() == ""] == []
    evaluation_rows = [line for line in rows if line.split("│")[2].strip() in ("prefill", "decode", "all")]
    assert len(evaluation_rows) == 12 and all(line.count("%") == 14 for line in evaluation_rows)
    assert max(map(len, lines)) > 80

    folder = tmp_path / "report"
    page = (folder / "index.html").read_text()
    for name in ("model.json", "summary.json", "coverage.json", "boundary_search.json"):
        assert f"href='{name}'" in page and json.loads((folder / name).read_text())
    assert "<pre>" not in page, "raw JSON belongs behind the links, not in the page"
    model = json.loads((folder / "model.json").read_text())
    coverage = json.loads((folder / "coverage.json").read_text())
    info = model["fit_info"]
    train = read_trace(trace_path(TRAIN_TRACE))
    assert coverage["n_steps"] == train.n_steps - info["n_warmup_dropped"]
    assert info["n_steps_used"] == coverage["n_steps"] - info["n_outliers_dropped"] - info.get("n_drifted_dropped", 0)
    for count in (train.n_steps, info["n_warmup_dropped"], coverage["n_steps"], info["n_outliers_dropped"], info["n_steps_used"]):
        assert f"{count:,}" in page
    for name in model["feature_names"]:
        assert f"<code>{name}</code>" in page
