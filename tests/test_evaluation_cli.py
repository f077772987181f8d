"""Held-out evaluation, baselines and the CLI's JSON contracts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llmvisor.evaluation.baselines import PaperOLSBaseline, RandomForestBaseline, TokenCountBaseline
from llmvisor.errors import LlmvisorError
from llmvisor.evaluation.heldout import error_summary, evaluate
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import write_trace


def run_cli(*args, check=True):
    result = subprocess.run(
        [sys.executable, "-m", "llmvisor.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    if check and result.returncode != 0:
        raise AssertionError(result.stderr)
    return result


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    write_trace(synthetic_trace(1500, noise=0.04, run_id="train", seed=1), folder / "train.parquet")
    write_trace(synthetic_trace(400, noise=0.04, run_id="test", seed=2), folder / "test.csv")
    return folder


def test_error_summary_percentiles_and_intervals():
    measured = np.full(1000, 2.0)
    predicted = measured * (1 + np.linspace(0, 0.5, 1000))
    summary = error_summary(predicted, measured, n_bootstrap=200)
    assert summary["n_steps"] == 1000
    assert summary["rel_err_p50"] == pytest.approx(0.25, abs=1e-3)
    assert summary["rel_err_p90"] == pytest.approx(0.45, abs=1e-3)
    low, high = summary["rel_err_p90_ci95"]
    assert low <= summary["rel_err_p90"] <= high and high - low < 0.05


def test_evaluation_refuses_shared_runs():
    trace = synthetic_trace(100, run_id="same")
    with pytest.raises(LlmvisorError, match="held-out evaluation splits by run"):
        evaluate(trace, synthetic_trace(50, run_id="same", seed=2))


def test_baselines_fit_their_own_cost_models():
    train, test = synthetic_trace(1500, seed=1, noise=0.02), synthetic_trace(300, seed=2)
    for baseline in (TokenCountBaseline(), PaperOLSBaseline(), RandomForestBaseline(n_estimators=20)):
        predicted = baseline.fit(train).predict(test)
        assert predicted.shape == (test.n_steps,) and np.isfinite(predicted).all()
        relative = np.abs(predicted - test.step_latency_s_per_step) / test.step_latency_s_per_step
        assert np.median(relative) < 0.5


def test_warmup_steps_of_the_test_trace_are_excluded_and_counted():
    train = synthetic_trace(800, seed=1, run_id="a")
    test = synthetic_trace(100, seed=2, run_id="b")
    marked = np.zeros(test.n_slices, dtype=bool)
    marked[: test.step_offsets[3]] = True
    test.extra["is_warmup"] = marked
    result = evaluate(train, test, model_names=("llmvisor", "token_count"), n_bootstrap=0)
    assert result["n_test_warmup_excluded"] == 3
    assert result["models"]["llmvisor"]["all"]["n_steps"] == 97


def test_cli_eval_json_has_the_documented_shape(files):
    result = run_cli("eval", "--train", files / "train.parquet", "--test", files / "test.csv", "--json", "--bootstrap", "50")
    data = json.loads(result.stdout)
    assert set(data["models"]) == {"llmvisor", "paper_ols", "token_count", "random_forest"}
    for phases in data["models"].values():
        for phase in ("prefill", "decode", "all"):
            assert {"n_steps", "r2", "rel_err_p50", "rel_err_p90", "rel_err_p99"} <= set(phases[phase])
    for phase in ("prefill", "decode"):
        ratio = data["improvement"][phase]["p90"]
        expected = data["models"]["token_count"][phase]["rel_err_p90"] / data["models"]["llmvisor"][phase]["rel_err_p90"]
        assert ratio == pytest.approx(expected)


def test_cli_fit_then_attribute_conserves_measured_time(files, tmp_path):
    run_cli("fit", files / "train.parquet", "-o", tmp_path / "model.json")
    for rule in ("shapley", "proportional"):
        data = json.loads(run_cli("attribute", files / "test.csv", "--model", tmp_path / "model.json", "--json", "--rule", rule).stdout)
        assert data["rule"] == rule
        assert data["n_steps_split_equally"] == 0
        assert data["total_attributed_s"] == pytest.approx(data["total_measured_s"], rel=1e-9)
        assert sum(v["attributed_s"] for v in data["by"].values()) == pytest.approx(data["total_measured_s"], rel=1e-9)
        assert sum(v["fraction"] for v in data["by"].values()) == pytest.approx(1.0)
    paper = json.loads(run_cli("attribute", files / "test.csv", "--model", tmp_path / "model.json", "--json", "--rule", "paper").stdout)
    assert paper["total_attributed_s"] < paper["total_measured_s"]
    by_request = json.loads(run_cli("attribute", files / "test.csv", "--model", tmp_path / "model.json", "--json", "--by", "request").stdout)
    assert all(key.startswith("test/") for key in by_request["by"])


def test_cli_attribute_reports_the_steps_it_split_equally(files, tmp_path):
    """A model predicting ≤ 0 for every request (possible under OLS) falls back to equal splits: counted."""
    from llmvisor.core.features import FEATURE_NAMES
    from llmvisor.core.model import StepLatencyModel

    negative = dict.fromkeys(FEATURE_NAMES, 0.0) | {"intercept": -1e-3}
    StepLatencyModel.from_coefficients([negative]).to_json(tmp_path / "negative.json")
    data = json.loads(run_cli("attribute", files / "test.csv", "--model", tmp_path / "negative.json", "--json").stdout)
    assert data["n_steps_split_equally"] == data["n_steps"] > 0
    assert data["total_attributed_s"] == pytest.approx(data["total_measured_s"], rel=1e-9)


@pytest.mark.parametrize(
    "args,message",
    [
        (("attribute", "{test}", "--model", "{missing}"), "no such model file"),
        (("attribute", "{test}", "--model", "{model}", "--rule", "fair"), "--rule: expected one of"),
        (("attribute", "{test}", "--model", "{model}", "--by", "model"), "--by: expected tenant or request"),
        (("fit", "{test}", "-o", "{out}", "--segments", "many"), "--segments: expected auto, none or a number"),
        (("eval", "--train", "{test}", "--test", "{test}"), "in both the training and the test traces"),
    ],
)
def test_cli_user_errors_are_one_line_exit_2(files, tmp_path, args, message):
    model = tmp_path / "model.json"
    run_cli("fit", files / "train.parquet", "-o", model)
    paths = {"test": files / "test.csv", "missing": tmp_path / "nope.json", "model": model, "out": tmp_path / "o.json"}
    result = run_cli(*(a.format(**paths) for a in args), check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
