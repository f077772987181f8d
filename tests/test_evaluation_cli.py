"""Held-out evaluation, baselines and the CLI's JSON contracts."""

from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest

from _cli import invoke_cli
from _processes import cli_process
from llmvisor.cli.main import expand_multi_file_flags
from llmvisor.core.stats import bootstrap_quantile_ci
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import write_trace
from llmvisor.errors import LlmvisorError
from llmvisor.evaluation.baselines import (
    PaperOLSBaseline,
    RandomForestBaseline,
    StepLatencyPredictor,
    TokenCountBaseline,
)
from llmvisor.evaluation.heldout import (
    MODEL_FACTORIES,
    error_summary,
    evaluate,
)


def run_cli(*args, check=True):
    """``llmvisor ARGS`` in this process (`invoke_cli`): these tests check what a command computes and its JSON."""
    result = invoke_cli(*args, env={"COLUMNS": "200"})
    if check and result.returncode != 0:
        raise AssertionError(result.stderr)
    return result


def run_cli_process(*args):
    """``llmvisor ARGS`` as its own process (`cli_process`), for the refusals: one line on stderr, exit 2, no traceback."""
    return cli_process(*args, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    write_trace(synthetic_trace(1500, noise=0.04, run_id="train", seed=1), folder / "train.parquet")
    write_trace(synthetic_trace(400, noise=0.04, run_id="test", seed=2), folder / "test.csv")
    write_trace(synthetic_trace(300, noise=0.04, run_id="test2", seed=3), folder / "test2.parquet")
    return folder


def test_error_summary_percentiles_and_intervals():
    measured = np.full(1000, 2.0)
    predicted = measured * (1 + np.random.default_rng(0).permutation(np.linspace(0, 0.5, 1000)))  # neighbours unalike
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
            assert {"signed_err_p10", "signed_err_p50", "signed_err_p90", "signed_err_p50_ci95", "n_unseen_phase_fallback"} <= set(phases[phase])
            assert phases[phase]["signed_err_p10"] <= phases[phase]["signed_err_p50"] <= phases[phase]["signed_err_p90"]
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
    result = run_cli_process(*(a.format(**paths) for a in args))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def ar1(n: int, phi: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shocks = rng.standard_normal(n)
    out = np.empty(n)
    out[0] = shocks[0]
    for k in range(1, n):
        out[k] = phi * out[k - 1] + np.sqrt(1 - phi * phi) * shocks[k]
    return out


def test_block_bootstrap_with_single_step_blocks_matches_resampling_steps():
    values = np.random.default_rng(0).lognormal(size=2000)
    ours = bootstrap_quantile_ci(values, (50, 90, 99), n_resamples=2000, block_steps=1)["ci"]
    rng = np.random.default_rng(1)
    resampled = np.percentile(values[rng.integers(0, values.size, size=(2000, values.size))], [50, 90, 99], axis=1)
    exact = np.percentile(resampled, [2.5, 97.5], axis=1).T
    for k, q in enumerate((50, 90, 99)):
        assert ours[q] == pytest.approx(exact[k], rel=0.04)


def test_block_bootstrap_widens_intervals_where_neighbouring_steps_are_alike():
    values = np.abs(ar1(20_000, 0.95, seed=0))
    blocks = bootstrap_quantile_ci(values, (50, 90), n_resamples=400)
    steps = bootstrap_quantile_ci(values, (50, 90), n_resamples=400, block_steps=1)
    assert blocks["block_steps"] > 1
    for q in (50, 90):
        assert np.diff(blocks["ci"][q])[0] > 2 * np.diff(steps["ci"][q])[0]
        assert blocks["ci"][q][0] <= np.percentile(values, q) <= blocks["ci"][q][1]


def test_block_bootstrap_is_deterministic_under_a_seed_and_keeps_blocks_within_runs():
    values = np.random.default_rng(3).random(30)
    runs = np.array(["a"] * 10 + ["b"] * 7 + ["c"] * 13)
    first = bootstrap_quantile_ci(values, (50, 90), n_resamples=300, seed=5, groups=runs, block_steps=4)
    again = bootstrap_quantile_ci(values, (50, 90), n_resamples=300, seed=5, groups=runs, block_steps=4)
    other = bootstrap_quantile_ci(values, (50, 90), n_resamples=300, seed=6, groups=runs, block_steps=4)
    assert first == again and first["ci"] != other["ci"]
    assert first["n_blocks"] == 3 + 2 + 4  # ceil(10/4) + ceil(7/4) + ceil(13/4): no block spans two runs


def test_block_bootstrap_memory_does_not_grow_with_the_number_of_steps():
    peaks_mib = {}
    for n in (100_000, 2_000_000):
        values = np.abs(np.random.default_rng(n).standard_normal(n))
        runs = np.repeat(np.arange(4), n // 4)
        tracemalloc.start()
        bootstrap_quantile_ci(values, (50, 90, 99), n_resamples=200, groups=runs)
        peaks_mib[n] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    assert peaks_mib[2_000_000] < 100  # resampling steps would hold 2e6 · 200 · 8 B = 3 GB
    assert peaks_mib[2_000_000] < 1.5 * peaks_mib[100_000]


def test_signed_errors_show_a_model_that_predicts_low():
    measured = np.random.default_rng(0).uniform(0.01, 0.1, 3000)
    predicted = measured * np.random.default_rng(1).uniform(0.85, 0.95, 3000)
    summary = error_summary(predicted, measured, n_bootstrap=200)
    assert summary["signed_err_p50"] == pytest.approx(-0.10, abs=0.005)
    low, high = summary["signed_err_p50_ci95"]
    assert low <= summary["signed_err_p50"] <= high < 0
    assert summary["signed_err_p90"] < 0
    assert summary["underprediction_factor_p90"] == pytest.approx(1 / 0.86, rel=0.01)


def test_llmvisor_and_every_baseline_are_step_latency_predictors():
    for name, factory in MODEL_FACTORIES.items():
        assert isinstance(factory(), StepLatencyPredictor), name


def test_steps_of_a_phase_absent_from_training_are_counted_not_hidden():
    full = synthetic_trace(1500, seed=1, run_id="a", noise=0.02)
    prefill_only = full.select_steps(full.is_prefill_per_step)
    test = synthetic_trace(300, seed=2, run_id="b")
    n_decode = int((~test.is_prefill_per_step).sum())
    assert 0 < n_decode < test.n_steps
    result = evaluate(prefill_only, test, n_bootstrap=0)
    for name in MODEL_FACTORIES:
        counts = {phase: result["models"][name][phase]["n_unseen_phase_fallback"] for phase in ("prefill", "decode", "all")}
        assert counts == {"prefill": 0, "decode": n_decode, "all": n_decode}, name
    baseline = TokenCountBaseline().fit(prefill_only)
    baseline.predict(test)
    assert baseline.n_unseen_phase_fallback_ == {"prefill": 0, "decode": n_decode}
    seen_both = evaluate(full, test, model_names=("token_count",), n_bootstrap=0)
    assert seen_both["models"]["token_count"]["all"]["n_unseen_phase_fallback"] == 0


def test_several_files_may_follow_one_train_or_test_flag():
    assert expand_multi_file_flags(["--train", "a", "b", "--test", "c", "d", "--bootstrap", "5", "--json"], ("--train", "--test")) == [
        "--train", "a", "--train", "b", "--test", "c", "--test", "d", "--bootstrap", "5", "--json",
    ]


def test_cli_eval_takes_several_test_files_after_one_flag_as_the_readme_writes(files):
    one_flag = run_cli("eval", "--train", files / "train.parquet", "--test", files / "test.csv", files / "test2.parquet", "--json", "--bootstrap", "20")
    data = json.loads(one_flag.stdout)
    assert data["test_runs"] == ["test", "test2"]
    repeated = run_cli("eval", "--train", files / "train.parquet", "--test", files / "test.csv", "--test", files / "test2.parquet", "--json", "--bootstrap", "20")
    assert json.loads(repeated.stdout)["models"] == data["models"]


SHARING_COEF_S = {"decode_context_tokens": 6e-8, "effective_context_tokens": 1.2e-7}


def test_eval_reports_steps_with_and_without_shared_context_apart(tmp_path):
    from llmvisor.core.synthetic import DEFAULT_COEF_S

    coef = dict(DEFAULT_COEF_S, **SHARING_COEF_S)
    train = synthetic_trace(1500, coef_s=coef, shared_prefix_fraction=0.5, noise=0.03, run_id="train", seed=1)
    test = synthetic_trace(400, coef_s=coef, shared_prefix_fraction=0.5, noise=0.03, run_id="test", seed=2)
    write_trace(train, tmp_path / "train.parquet")
    write_trace(test, tmp_path / "test.parquet")
    data = json.loads(run_cli("eval", "--train", tmp_path / "train.parquet", "--test", tmp_path / "test.parquet", "--json", "--bootstrap", "20").stdout)
    shared = test.has_shared_context_per_step
    for name in ("llmvisor", "token_count"):
        groups = data["by_sharing"]
        assert set(groups) == {"shared", "unique"}
        assert groups["shared"][name]["all"]["n_steps"] == int(shared.sum()) > 0
        assert groups["unique"][name]["all"]["n_steps"] == int((~shared).sum()) > 0
        for phase in ("prefill", "decode", "all"):
            counts = groups["shared"][name][phase]["n_steps"] + groups["unique"][name][phase]["n_steps"]
            assert counts == data["models"][name][phase]["n_steps"]
        assert set(data["models"][name]["all"]) - {"n_unseen_phase_fallback"} == set(groups["shared"][name]["all"])
    assert data["by_sharing"]["shared"]["llmvisor"]["all"]["rel_err_p90"] < 0.1


def test_a_v1_test_trace_has_no_shared_steps():
    result = evaluate(synthetic_trace(600, run_id="a", seed=1), synthetic_trace(200, run_id="b", seed=2), model_names=("llmvisor",), n_bootstrap=0)
    assert result["by_sharing"]["shared"]["llmvisor"]["all"]["n_steps"] == 0
    assert result["by_sharing"]["unique"]["llmvisor"]["all"]["n_steps"] == result["models"]["llmvisor"]["all"]["n_steps"]
