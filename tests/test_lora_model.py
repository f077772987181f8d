"""The step-latency model with LoRA adapters (issue #38 item 2): on synthetic traces from known coefficients the fit
recovers the LoRA coefficients and chooses the per-token work form that made the trace, by held-out error grouped by
run; a LoRA model's file (format version 4) round-trips, a version-3 file still reads; a trace without the LoRA columns still gives the model and the
file it gave before LoRA (format version 2, no LoRA parameter), and a LoRA model prices such a trace by its base part."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmvisor.core.features import (
    FEATURE_NAMES,
    FEATURE_NAMES_LORA,
    FEATURE_NAMES_LORA_V3,
    LORA_FEATURE_NAMES,
    N_FEATURES,
    LoraCoef,
    lora_own_s,
    lora_slices_of,
    own_terms_s,
    slice_feature_matrix,
    step_feature_matrix,
)
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S, DEFAULT_LORA_COEF_S, DEFAULT_LORA_RANKS, synthetic_trace
from llmvisor.core.trace import StepTrace, concat_traces, read_trace, write_trace
from llmvisor.errors import LlmvisorError, ModelError
from llmvisor.evaluation.baselines import AdapterBlindModel, StepLatencyPredictor, without_lora_columns
from llmvisor.evaluation.heldout import evaluate

RANK_WORK = {**DEFAULT_COEF_S, **DEFAULT_LORA_COEF_S, "lora_steps": 1.5e-3, "lora_base_tokens": 5e-6}
"""Work that follows the adapter's rank (the synthetic engine's default), and the LoRA path's terms."""
PADDED_WORK = {**RANK_WORK, "prefill_lora_rank_x_tokens": 0.0, "decode_lora_rank_x_tokens": 0.0,
               "prefill_lora_tokens": 4e-5, "decode_lora_tokens": 1.5e-4}
"""Work that follows the tokens run with any adapter, whatever its rank (vLLM pads adapters to the maximum rank)."""


def runs(coef_s, n_runs=3, n_steps=800, noise=0.0, seed=10, name="run") -> StepTrace:
    return concat_traces([
        synthetic_trace(n_steps, coef_s=coef_s, max_batch_size=16, lora_ranks=DEFAULT_LORA_RANKS, noise=noise,
                        run_id=f"{name}-{k}", seed=seed + k)
        for k in range(n_runs)
    ])


@pytest.mark.parametrize(("coef_s", "form"), [(RANK_WORK, "rank_tokens"), (PADDED_WORK, "tokens")])
def test_the_fit_recovers_the_lora_coefficients_and_chooses_the_form_that_made_the_trace(coef_s, form):
    model = StepLatencyModel(segments="none").fit(runs(coef_s))
    report = model.fit_info_["lora_work"]
    assert report["mode"] == "auto" and report["fold_grouping"] == "run" and report["n_folds"] == 3
    assert report["chosen"] == form
    assert model.is_lora_ and list(model.feature_names_) == list(FEATURE_NAMES_LORA)
    got = dict(zip(FEATURE_NAMES_LORA, model.coef_[0]))
    for name in LORA_FEATURE_NAMES:
        assert got[name] == pytest.approx(coef_s[name], rel=1e-6, abs=1e-12), name
    other = "tokens" if form == "rank_tokens" else "rank_tokens"
    assert report["candidates"][form]["cv_mean_squared_rel_err"] < report["candidates"][other]["cv_mean_squared_rel_err"]
    assert set(report["held_at_zero"]) == {n for n in LORA_FEATURE_NAMES[:4] if coef_s[n] == 0}


@pytest.mark.parametrize(("coef_s", "form"), [(RANK_WORK, "rank_tokens"), (PADDED_WORK, "tokens")])
def test_with_noise_the_form_is_still_chosen_and_the_coefficients_are_close(coef_s, form):
    model = StepLatencyModel(segments="none").fit(runs(coef_s, noise=0.03))
    assert model.fit_info_["lora_work"]["chosen"] == form
    got = dict(zip(FEATURE_NAMES_LORA, model.coef_[0]))
    for name in LORA_FEATURE_NAMES:
        assert got[name] == pytest.approx(coef_s[name], rel=0.1, abs=1e-12), name


def test_a_fixed_lora_work_form_holds_the_others_at_zero_and_an_adapter_blind_model_is_worse_held_out():
    train, test = runs(RANK_WORK, noise=0.02), runs(RANK_WORK, n_runs=1, noise=0.02, seed=40)
    fixed = StepLatencyModel(segments="none", lora_work="tokens").fit(train)
    assert fixed.fit_info_["lora_work"] == {"mode": "fixed", "chosen": "tokens",
                                            "held_at_zero": ["prefill_lora_rank_x_tokens", "decode_lora_rank_x_tokens"]}
    assert fixed.coef_[0, LoraCoef.L2] == 0 and fixed.coef_[0, LoraCoef.L4] == 0
    assert not fixed.identified_[LoraCoef.L2] and fixed.identified_[LoraCoef.L1]
    aware = StepLatencyModel(segments="none").fit(train)
    blind = StepLatencyModel(segments="none").fit(without_lora_columns(train))
    assert not blind.is_lora_
    measured = test.step_latency_s_per_step
    errors = {name: np.percentile(np.abs(m.predict(test) - measured) / measured, 90)
              for name, m in (("aware", aware), ("fixed", fixed), ("blind", blind))}
    assert errors["aware"] < errors["fixed"] < errors["blind"]


def test_a_trace_without_lora_columns_gives_the_file_it_gave_before_lora(tmp_path):
    """Same features, format version 2, no LoRA parameter and no LoRA report: what a model file held before LoRA."""
    trace = synthetic_trace(600, shared_prefix_fraction=0.3, noise=0.03, seed=4)
    model = StepLatencyModel().fit(trace)
    data = model.to_dict()
    assert not model.is_lora_ and model.coef_.shape[1] == N_FEATURES
    assert data["format_version"] == 2 and data["feature_names"] == list(FEATURE_NAMES)
    assert "lora_work" not in data["params"] and "lora_work" not in data["fit_info"]
    assert not set(LORA_FEATURE_NAMES) & set(data["fit_info"]["unidentified_features"])
    # the LoRA hyper-parameter changes nothing here
    other = StepLatencyModel(lora_work="both").fit(trace).to_dict()
    assert json.dumps(other) == json.dumps(data)
    # and a LoRA trace stripped of its columns gives a base model's file
    lora = runs(RANK_WORK, n_runs=2, noise=0.02)
    stripped = StepLatencyModel(segments="none").fit(without_lora_columns(lora)).to_dict()
    assert stripped["format_version"] == 2 and stripped["feature_names"] == list(FEATURE_NAMES)


def test_a_lora_models_file_round_trips_and_old_files_still_read(tmp_path):
    model = StepLatencyModel(segments="none").fit(runs(RANK_WORK, noise=0.02))
    model.to_json(tmp_path / "lora.json")
    data = json.loads((tmp_path / "lora.json").read_text())
    assert data["format_version"] == 4 and data["feature_names"] == list(FEATURE_NAMES_LORA)
    assert data["params"]["lora_work"] == "auto" and data["fit_info"]["lora_work"]["chosen"] == "rank_tokens"
    loaded = StepLatencyModel.from_json(tmp_path / "lora.json")
    assert loaded.is_lora_ and loaded.get_params() == model.get_params()
    test = runs(RANK_WORK, n_runs=1, seed=50)
    np.testing.assert_array_equal(loaded.predict(test), model.predict(test))
    np.testing.assert_array_equal(loaded.identified_, model.identified_)
    # a version-3 file (before the LoRA path's terms) reads with them held at 0: it prices what it always did
    old = json.loads(json.dumps(data))
    old.update(format_version=3, feature_names=list(FEATURE_NAMES_LORA_V3),
               identified_features=[n for n in data["identified_features"] if n in FEATURE_NAMES_LORA_V3])
    for name in ("lora_steps", "lora_base_tokens"):
        old["segments"][0]["coef_s"].pop(name)
    (tmp_path / "v3.json").write_text(json.dumps(old))
    v3 = StepLatencyModel.from_json(tmp_path / "v3.json")
    assert v3.is_lora_ and v3.coef_[0, LoraCoef.L8] == v3.coef_[0, LoraCoef.L9] == 0.0
    assert not v3.identified_[LoraCoef.L8] and not v3.identified_[LoraCoef.L9]
    without_path = model.coef_.copy()
    without_path[:, [LoraCoef.L8, LoraCoef.L9]] = 0.0
    np.testing.assert_allclose(v3.predict(test), StepLatencyModel.from_coefficients([dict(zip(FEATURE_NAMES_LORA, without_path[0]))]).predict(test),
                               rtol=1e-12)
    assert v3.to_dict()["format_version"] == 4  # written again, it is a current file
    # a version-4 file with a misspelt LoRA coefficient is refused naming the closest feature
    data["segments"][0]["coef_s"]["lora_adapter"] = data["segments"][0]["coef_s"].pop("lora_adapters")
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="lora_adapters"):
        StepLatencyModel.from_json(tmp_path / "bad.json")
    # a base model's file is still version 2, and from_coefficients without LoRA names makes one
    base = StepLatencyModel.from_coefficients([DEFAULT_COEF_S])
    assert not base.is_lora_ and base.to_dict()["format_version"] == 2
    assert StepLatencyModel.from_coefficients([{**DEFAULT_COEF_S, "lora_adapters": 1e-4}]).is_lora_


def test_a_lora_model_prices_a_trace_without_lora_columns_by_its_base_part():
    model = StepLatencyModel(segments="none").fit(runs(RANK_WORK, noise=0.02))
    base = StepLatencyModel.from_coefficients([dict(zip(FEATURE_NAMES, model.coef_[0, :N_FEATURES]))])
    old = synthetic_trace(300, shared_prefix_fraction=0.3, seed=7)
    np.testing.assert_array_equal(model.predict(old), base.predict(old))
    assert model.score(old) == base.score(old)


def test_lora_features_are_the_slice_terms_and_a_written_trace_reads_back_the_same(tmp_path):
    trace = synthetic_trace(200, lora_ranks=DEFAULT_LORA_RANKS, lora_load_probability=0.4, seed=3)
    path = tmp_path / "lora.parquet"
    write_trace(trace, path)
    again = read_trace(path)
    np.testing.assert_array_equal(step_feature_matrix(again), step_feature_matrix(trace))
    lora = lora_slices_of(again)
    rng = np.random.default_rng(0)
    coef = rng.random(len(FEATURE_NAMES_LORA))
    x = slice_feature_matrix(again.num_new_tokens, again.num_context_tokens, again.is_prefill, None, lora)
    np.testing.assert_allclose(x @ coef, own_terms_s(coef, again.num_new_tokens, again.num_context_tokens, again.is_prefill,
                                                     None, lora), rtol=1e-12)
    # per step the shares add up to the step's distinct adapters and loads
    steps = step_feature_matrix(again)
    distinct = [len(json.loads(t)) for t in again.extra["step_loras"][again.step_starts]]
    loads = [len(json.loads(t)) for t in again.extra["step_lora_loads"][again.step_starts]]
    disk = [len(json.loads(t)) for t in again.extra["step_lora_disk_loads"][again.step_starts]]
    np.testing.assert_allclose(steps[:, LoraCoef.L5], distinct, rtol=1e-12)
    np.testing.assert_allclose(steps[:, LoraCoef.L6], loads, rtol=1e-12)
    np.testing.assert_allclose(steps[:, LoraCoef.L7], disk, rtol=1e-12)
    assert sum(disk) > 0
    # a base-model row has no LoRA part
    assert lora_own_s(coef[:N_FEATURES], again.num_new_tokens, again.is_prefill, lora) == 0.0


def test_disk_loads_are_not_identified_when_every_load_reads_the_disk():
    trace = runs(RANK_WORK, n_runs=2)
    for column in ("step_lora_disk_loads",):
        trace.extra[column] = trace.extra["step_lora_loads"].copy()
    model = StepLatencyModel(segments="none").fit(trace)
    assert "lora_disk_loads" in model.fit_info_["unidentified_features"]
    assert model.coef_[0, LoraCoef.L7] == 0
    assert "lora_disk_loads" not in model.to_dict()["identified_features"]


def test_a_trace_with_lora_columns_but_no_adapter_traffic_holds_every_lora_term_at_zero():
    trace = synthetic_trace(400, lora_ranks=DEFAULT_LORA_RANKS, lora_fraction=0.0, noise=0.02, seed=6)
    model = StepLatencyModel(segments="none").fit(trace)
    assert model.is_lora_ and not model.coef_[0, N_FEATURES:].any()
    assert model.fit_info_["lora_work"]["mode"] == "none"
    assert set(LORA_FEATURE_NAMES) <= set(model.fit_info_["unidentified_features"])


def test_lora_work_is_checked_by_fit():
    with pytest.raises(LlmvisorError, match="parameter lora_work must be"):
        StepLatencyModel(lora_work="rank").fit(synthetic_trace(60))


def test_held_out_evaluation_judges_the_adapter_blind_model_and_the_adapter_steps_apart(tmp_path):
    """`evaluate` (what `llmvisor eval` runs) adds the adapter-blind model when the training runs carry the LoRA columns
    and reports the steps that ran an adapter apart; on a synthetic engine whose adapters cost time the LoRA-aware
    model is the better there, and on a trace without adapters nothing changes."""
    train, test = runs(RANK_WORK, noise=0.02), runs(RANK_WORK, n_runs=1, noise=0.02, seed=40, name="held-out")
    result = evaluate(train, test, n_bootstrap=50)
    assert isinstance(AdapterBlindModel(), StepLatencyPredictor)
    assert list(result["models"]) == ["llmvisor", "paper_ols", "token_count", "random_forest", "adapter_blind"]
    assert not result["fitted"]["adapter_blind"].model_.is_lora_ and result["fitted"]["llmvisor"].is_lora_
    adapter, base = result["by_lora"]["adapter"], result["by_lora"]["base"]
    for name in result["models"]:
        assert adapter[name]["all"]["n_steps"] + base[name]["all"]["n_steps"] == result["models"][name]["all"]["n_steps"]
    assert adapter["llmvisor"]["all"]["n_steps"] > 0 and base["llmvisor"]["all"]["n_steps"] > 0
    aware, blind = adapter["llmvisor"]["all"], adapter["adapter_blind"]["all"]
    assert aware["rel_err_p90_ci95"][1] < blind["rel_err_p90_ci95"][0]
    # the blind model is llmvisor's model on the trace without the LoRA columns, its own rules and all
    alone = StepLatencyModel().fit(without_lora_columns(train))
    np.testing.assert_array_equal(result["predictions"]["adapter_blind"], alone.predict(test))

    plain = synthetic_trace(400, noise=0.02, run_id="a", seed=1), synthetic_trace(200, noise=0.02, run_id="b", seed=2)
    old = evaluate(*plain, n_bootstrap=0)
    assert "adapter_blind" not in old["models"] and old["by_lora"] == {}

    # the command prints the adapter steps' table
    write_trace(train, tmp_path / "train.parquet")
    write_trace(test, tmp_path / "test.parquet")
    from typer.testing import CliRunner

    from llmvisor.cli.main import app

    shown = CliRunner().invoke(app, ["eval", "--train", str(tmp_path / "train.parquet"), "--test", str(tmp_path / "test.parquet"),
                                     "--bootstrap", "20"], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    assert "steps that ran a LoRA adapter" in shown.output and "adapter_blind" in shown.output
