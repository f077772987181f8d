"""The step-latency model: recovery of known coefficients, the boundary search, the stated drop rules, JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmvisor.core.features import FEATURE_NAMES, step_new_tokens
from llmvisor.core.model import PARAMETER_CONSTRAINTS, StepLatencyModel, composition_groups, group_k_fold
from llmvisor.core.synthetic import DEFAULT_COEF_S, synthetic_trace
from llmvisor.core.trace import StepTrace, concat_traces, read_trace
from llmvisor.errors import LlmvisorError, ModelError, NotFittedError
from llmvisor.shipped import HELD_OUT_TRACES, latency_model_path, trace_path

TRUE = np.array([DEFAULT_COEF_S[name] for name in FEATURE_NAMES])


@pytest.mark.parametrize("positive", [True, False])
def test_fit_recovers_known_coefficients(positive):
    trace = synthetic_trace(3000, seed=11)
    model = StepLatencyModel(segments="none", positive=positive).fit(trace)
    np.testing.assert_allclose(model.coef_[0], TRUE, rtol=1e-6)
    assert model.boundary_ is None
    assert model.rank_ == len(FEATURE_NAMES) - 1
    assert model.fit_info_["unidentified_features"] == ["effective_context_tokens"]


def test_fit_with_noise_is_close_and_predicts_held_out_steps():
    model = StepLatencyModel(segments="none").fit(synthetic_trace(4000, noise=0.03, seed=1))
    well_identified = [0, 1, 2, 4, 6, 7]
    np.testing.assert_allclose(model.coef_[0][well_identified], TRUE[well_identified], rtol=0.1)
    test = synthetic_trace(500, seed=2)
    relative = np.abs(model.predict(test) - test.step_latency_s_per_step) / test.step_latency_s_per_step
    assert np.percentile(relative, 90) < 0.01


def piecewise_trace(boundary: float, seed: int) -> StepTrace:
    """Steps below the boundary timed by one coefficient set, the others by a set twice as expensive per token."""
    low = synthetic_trace(3000, max_new_tokens=600, seed=seed, run_id="a")
    load = np.add.reduceat(low.num_new_tokens.astype(float), low.step_starts)
    compute_bound = dict(DEFAULT_COEF_S, prefill_new_tokens=6e-4, intercept=2e-2)
    high = synthetic_trace(3000, max_new_tokens=600, seed=seed, run_id="a", coef_s=compute_bound)
    latency = np.where(load >= boundary, high.step_latency_s_per_step, low.step_latency_s_per_step)
    low.step_latency_s[:] = np.repeat(latency, low.batch_size_per_step)
    return low


def test_auto_segments_find_a_real_boundary_and_keep_none_when_there_is_none():
    trace = piecewise_trace(boundary=500, seed=3)
    model = StepLatencyModel(segments="auto").fit(trace)
    assert model.boundary_ is not None
    assert model.segment_names_ == ("memory_bound", "compute_bound")
    candidates = model.fit_info_["boundary_search"]["candidates"]
    chosen = model.fit_info_["boundary_search"]["decode_counts"]["against"]  # the search's own choice, before decode counts
    assert candidates[chosen]["cv_mean_squared_rel_err"] < candidates["none"]["cv_mean_squared_rel_err"]
    plain = StepLatencyModel(segments="auto").fit(synthetic_trace(3000, noise=0.03, seed=4))
    assert plain.boundary_ is None
    assert plain.fit_info_["boundary_search"]["chosen"] == "none"


def decode_jump_trace(seed: int, n_steps: int = 3000, jump_at: int = 14) -> tuple[StepTrace, np.ndarray]:
    """Steps timed by the default coefficients, except that a decode-only step of ``jump_at`` requests or more takes twice
    as long (as the LoRA engine's decode steps do from 9: docs/attribution.md). No prefill step is that light, so a
    segment below the jump holds only decode steps. Also the mask of the slow steps."""
    trace = synthetic_trace(n_steps, max_batch_size=16, noise=0.03, seed=seed)
    trace = trace.select_steps(~trace.is_prefill_per_step | (step_new_tokens(trace) >= jump_at))
    slow = ~trace.is_prefill_per_step & (trace.batch_size_per_step >= jump_at)
    trace.step_latency_s[:] = np.repeat(trace.step_latency_s_per_step * np.where(slow, 2.0, 1.0), trace.batch_size_per_step)
    return trace, slow


def test_a_jump_in_decode_step_cost_at_a_count_of_sequences_is_found_where_the_search_alone_missed_it():
    """The one-segment outlier rule drops every slow step (so the search never sees the jump), and a segment of only decode
    steps cannot identify the prefill terms (so the search cannot place it): the decode-count candidates do both."""
    trace, slow = decode_jump_trace(seed=1)
    model = StepLatencyModel().fit(trace)
    search = model.fit_info_["boundary_search"]
    counts = search["decode_counts"]
    assert model.boundary_ == 14.0 and search["chosen"] == "decode count 14" and counts["chosen"] == "14"
    assert counts["against"] != "14" and search["candidates"].get("14", {"skipped": True}).get("skipped")
    chosen = counts["candidates"]["14"]
    assert chosen["gain"] > chosen["gain_standard_error"] > 0 and chosen["n_readmitted_above"] == slow.sum()
    assert model.train_step_mask_[slow].all() and "two-segment (boundary 14)" in model.fit_info_["outlier_rule"]
    prefill = [FEATURE_NAMES.index(n) for n in ("prefill_new_tokens", "prefill_new_tokens_squared", "prefill_new_x_context_tokens")]
    assert chosen["borrowed_features"]["memory_bound"][:2] == ["prefill_new_tokens", "prefill_context_tokens"]
    np.testing.assert_array_equal(model.coef_[0][prefill], model.coef_[1][prefill])  # taken from the segment with prefill steps
    # what the search alone chose (the fit before these candidates): it drops the slow steps and misses them held out
    alone = StepLatencyModel(segments="none" if counts["against"] == "none" else float(counts["against"])).fit(trace)
    assert not alone.train_step_mask_[slow].any()
    test, test_slow = decode_jump_trace(seed=2, n_steps=1000)
    measured = test.step_latency_s_per_step
    for fitted, most in ((model, 0.15), (alone, None)):
        relative = np.abs(fitted.predict(test) - measured)[test_slow] / measured[test_slow]
        assert (np.percentile(relative, 90) < most) if most else (np.percentile(relative, 90) > 0.4)


def test_decode_count_candidates_leave_a_fit_without_such_a_jump_as_the_search_made_it():
    """Where the one-segment outlier rule dropped no run of decode-only steps above a count, no decode-count candidate is tried."""
    model = StepLatencyModel().fit(synthetic_trace(3000, max_batch_size=16, noise=0.03, seed=4))
    counts = model.fit_info_["boundary_search"]["decode_counts"]
    assert counts["chosen"] is None and counts["candidates"]
    assert all("skipped" in c for c in counts["candidates"].values())
    assert model.fit_info_["boundary_search"]["chosen"] == counts["against"]


def test_boundary_search_folds_by_run_when_there_are_several():
    runs = [synthetic_trace(400, seed=s, run_id=f"run{s}", noise=0.02) for s in range(3)]
    model = StepLatencyModel().fit(concat_traces(runs))
    assert model.fit_info_["boundary_search"]["fold_grouping"] == "run"
    assert model.fit_info_["boundary_search"]["n_folds"] == 3


def test_outlier_rule_drops_only_the_slow_tail_and_counts_it():
    trace = synthetic_trace(2000, noise=0.02, seed=5)
    slow = np.zeros(trace.n_steps, dtype=bool)
    slow[::100] = True
    latency = trace.step_latency_s_per_step * np.where(slow, 3.0, 1.0)
    trace.step_latency_s[:] = np.repeat(latency, trace.batch_size_per_step)
    model = StepLatencyModel(segments="none").fit(trace)
    assert model.fit_info_["n_outliers_dropped"] >= slow.sum()
    assert model.fit_info_["n_outliers_dropped"] < 3 * slow.sum()
    np.testing.assert_allclose(model.coef_[0][[0, 1, 7]], TRUE[[0, 1, 7]], rtol=0.1)
    kept_all = StepLatencyModel(segments="none", outlier_threshold=None).fit(trace)
    assert kept_all.fit_info_["n_outliers_dropped"] == 0
    assert abs(kept_all.coef_[0][0] - TRUE[0]) > abs(model.coef_[0][0] - TRUE[0])


def test_warmup_steps_are_dropped_only_when_marked():
    trace = synthetic_trace(600, seed=6)
    marked = np.zeros(trace.n_slices, dtype=bool)
    marked[: trace.step_offsets[5]] = True
    trace.extra["is_warmup"] = marked
    model = StepLatencyModel(segments="none").fit(trace)
    assert model.fit_info_["n_warmup_dropped"] == 5
    assert StepLatencyModel(segments="none", drop_warmup=False).fit(trace).fit_info_["n_warmup_dropped"] == 0


def test_unidentified_features_are_held_at_zero_and_reported():
    trace = synthetic_trace(800, seed=7)
    trace.num_context_tokens[trace.is_prefill] = 0
    model = StepLatencyModel(segments="none").fit(trace)
    assert set(model.fit_info_["unidentified_features"]) == {
        "prefill_context_tokens",
        "prefill_new_x_context_tokens",
        "effective_context_tokens",
    }
    assert model.coef_[0][FEATURE_NAMES.index("prefill_new_x_context_tokens")] == 0


def test_nnls_keeps_coefficients_nonnegative_where_ols_does_not():
    coef = dict(DEFAULT_COEF_S, decode_context_tokens=-5e-8)
    trace = synthetic_trace(1500, coef_s=coef, seed=8)
    assert StepLatencyModel(segments="none", positive=False).fit(trace).coef_.min() < 0
    assert StepLatencyModel(segments="none").fit(trace).coef_.min() >= 0


def test_json_round_trip_predicts_the_same(tmp_path):
    model = StepLatencyModel(segments=400).fit(piecewise_trace(400, seed=9))
    model.to_json(tmp_path / "m.json")
    loaded = StepLatencyModel.from_json(tmp_path / "m.json")
    test = synthetic_trace(300, seed=10)
    np.testing.assert_array_equal(loaded.predict(test), model.predict(test))
    assert loaded.boundary_ == 400
    assert loaded.get_params() == model.get_params()
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["format_version"] == 2 and data["segments"][0]["name"] == "memory_bound"
    assert data["feature_names"][-1] == "effective_context_tokens"


def test_bad_model_files_are_clear_errors(tmp_path):
    model = StepLatencyModel(segments="none").fit(synthetic_trace(300, seed=1))
    data = model.to_dict()
    for mutate, reason in [
        (lambda d: d.update(format_version=99), "version 99 is not supported"),
        (lambda d: d.update(format="other"), "not an llmvisor model file"),
        (lambda d: d.pop("segments"), "malformed model file"),
        (lambda d: d.update(boundary_new_tokens=100.0), "expected 2 coefficient sets"),
    ]:
        broken = json.loads(json.dumps(data))
        mutate(broken)
        (tmp_path / "m.json").write_text(json.dumps(broken))
        with pytest.raises(ModelError, match=reason):
            StepLatencyModel.from_json(tmp_path / "m.json")
    (tmp_path / "m.json").write_text("{")
    with pytest.raises(ModelError, match="not valid JSON"):
        StepLatencyModel.from_json(tmp_path / "m.json")


def test_unfitted_model_and_bad_params_are_clear_errors():
    with pytest.raises(NotFittedError):
        StepLatencyModel().predict(synthetic_trace(3))
    with pytest.raises(LlmvisorError, match="weights"):
        StepLatencyModel(weights="square").fit(synthetic_trace(50))


def test_speculative_decode_slices_are_refused_by_the_model():
    trace = synthetic_trace(50, seed=2)
    trace.num_new_tokens[~trace.is_prefill] = 2
    with pytest.raises(LlmvisorError, match="speculative"):
        StepLatencyModel().fit(trace)


# ---------------------------------------------------------------------------------------------------------
# The scikit-learn estimator contract (scikit-learn is a test dependency, not a core one)


def test_clone_gives_an_unfitted_copy_with_the_same_parameters():
    from sklearn.base import clone

    model = StepLatencyModel(segments=300.0, positive=False, outlier_threshold=None, cv_folds=3)
    model.fit(synthetic_trace(300, seed=1))
    copy = clone(model)
    assert copy.get_params() == model.get_params()
    assert not hasattr(copy, "coef_")
    with pytest.raises(NotFittedError):
        copy.check_is_fitted()
    model.check_is_fitted()


def test_get_params_reads_every_init_parameter_and_set_params_sets_them():
    model = StepLatencyModel()
    params = model.get_params(deep=True)
    assert set(params) == set(PARAMETER_CONSTRAINTS)
    assert model.set_params(segments="none", cv_folds=4) is model
    assert model.get_params()["segments"] == "none" and model.cv_folds == 4
    with pytest.raises(LlmvisorError, match="no parameter 'segment'"):
        model.set_params(segment="none")


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("segments", "some"),
        ("segments", -5),
        ("segments", True),
        ("positive", "yes"),
        ("weights", "square"),
        ("outlier_threshold", 0),
        ("drop_warmup", 1),
        ("cv_folds", 1),
        ("cv_folds", 2.5),
        ("n_boundary_candidates", 0),
        ("min_steps_per_segment", "40"),
    ],
)
def test_every_parameter_is_checked_by_fit(name, bad):
    with pytest.raises(LlmvisorError, match=f"parameter {name} must be"):
        StepLatencyModel(**{name: bad}).fit(synthetic_trace(60))


def test_fit_returns_self_and_learned_attributes_end_in_underscore():
    model = StepLatencyModel(segments="none")
    assert model.fit(synthetic_trace(200, seed=3)) is model
    learned = set(vars(model)) - set(model.get_params())
    assert learned and all(name.endswith("_") for name in learned)


def test_grid_search_with_group_folds_drives_the_model_on_a_trace():
    from sklearn.model_selection import GridSearchCV, GroupKFold

    trace = piecewise_trace(boundary=500, seed=3)
    episodes = np.arange(trace.n_steps) // 500
    search = GridSearchCV(
        StepLatencyModel(outlier_threshold=None),
        {"segments": ["none", 500.0], "positive": [True, False]},
        cv=GroupKFold(n_splits=3),
    )
    search.fit(trace, groups=episodes)
    assert search.best_params_["segments"] == 500.0
    scores = search.cv_results_["mean_test_score"]
    with_boundary = [s for s, p in zip(scores, search.cv_results_["params"]) if p["segments"] == 500.0]
    without = [s for s, p in zip(scores, search.cv_results_["params"]) if p["segments"] == "none"]
    assert min(with_boundary) > max(without)
    assert search.best_estimator_.boundary_ == 500.0
    assert search.score(trace) == search.best_estimator_.score(trace) <= 0


def test_a_repeated_sweep_keeps_identical_compositions_in_one_fold():
    once = synthetic_trace(300, seed=7, noise=0.02)
    repeated = once.take_steps(np.concatenate([np.arange(300), np.arange(300)]))
    groups = composition_groups(repeated)
    assert np.array_equal(groups[:300], groups[300:])
    assert np.unique(groups).size == np.unique(composition_groups(once)).size
    for test in group_k_fold(groups, 5):
        assert not (set(groups[test]) & set(groups[~test]))
    model = StepLatencyModel().fit(repeated)
    search = model.fit_info_["boundary_search"]
    assert search["fold_grouping"] == "time_block"
    folds_of = fold_assignment(StepLatencyModel.fold_groups(repeated)[0])
    assert np.array_equal(folds_of[:300], folds_of[300:])  # each step's repeat is in its fold


def fold_assignment(groups: np.ndarray) -> np.ndarray:
    fold = np.full(groups.size, -1)
    for k, test in enumerate(group_k_fold(groups, 5)):
        fold[test] = k
    return fold


def decode_runs_trace(n_runs: int, steps_per_run: int, seed: int = 0):
    """One recording of back-to-back decode runs: each run's requests decode together, one token further each step
    (neighbouring steps nearly identical), and the next run starts with new requests."""
    from llmvisor.core.trace import trace_from_rows

    rng = np.random.default_rng(seed)
    rows, step = [], 0
    for run in range(n_runs):
        batch, context = int(rng.integers(1, 6)), int(rng.integers(10, 2000))
        for k in range(steps_per_run):
            latency = (0.01 + 1e-6 * batch * (context + k)) * (1 + 0.01 * rng.standard_normal())
            for i in range(batch):
                rows.append({"run_id": "sweep", "step_id": step, "request_id": f"r{run}-{i}", "tenant": "t",
                             "phase": "decode", "num_new_tokens": 1, "num_context_tokens": context + k,
                             "step_latency_s": latency})
            step += 1
    return trace_from_rows(rows)


def test_adjacent_near_identical_steps_never_sit_on_both_sides_of_a_fold():
    """Within one run without an episode column the folds are contiguous stretches of shared requests: a step that
    shares a request with the step before it (one decode token further) is always in that step's fold. Composition
    groups did not ensure it: consecutive decode steps differ by one context token, so each was its own group."""
    trace = decode_runs_trace(40, 25)
    groups, grouping = StepLatencyModel.fold_groups(trace)
    assert grouping == "time_block" and 30 <= np.unique(groups).size <= 40  # runs with a common composition are joined
    fold = fold_assignment(groups)
    requests = [set(trace.request_id[trace.step_offsets[k]:trace.step_offsets[k + 1]].tolist()) for k in range(trace.n_steps)]
    neighbours = [k for k in range(1, trace.n_steps) if requests[k] & requests[k - 1]]
    assert len(neighbours) == 40 * 24
    assert all(fold[k] == fold[k - 1] for k in neighbours)
    old = fold_assignment(composition_groups(trace))  # the earlier grouping split some neighbours
    assert sum(old[k] != old[k - 1] for k in neighbours) > 0


def test_composition_groups_ignore_slice_order_and_tell_compositions_apart():
    trace = synthetic_trace(200, seed=2)
    reversed_slices = trace.take_steps(np.arange(trace.n_steps))
    for k in range(trace.n_steps):
        s = slice(trace.step_offsets[k], trace.step_offsets[k + 1])
        for name in ("num_new_tokens", "num_context_tokens", "is_prefill"):
            getattr(reversed_slices, name)[s] = getattr(trace, name)[s][::-1]
    assert np.array_equal(composition_groups(trace), composition_groups(reversed_slices))
    changed = trace.take_steps(np.arange(trace.n_steps))
    changed.num_context_tokens[0] += 1
    assert composition_groups(changed)[0] != composition_groups(trace)[0]


def test_an_episode_column_groups_the_folds_of_a_single_run():
    trace = synthetic_trace(600, seed=4, noise=0.02)
    trace.extra["episode"] = np.repeat(np.arange(trace.n_steps) // 100, trace.batch_size_per_step)
    search = StepLatencyModel().fit(trace).fit_info_["boundary_search"]
    assert search["fold_grouping"] == "episode" and search["n_groups"] == 6


SHARING_COEF_S = dict(DEFAULT_COEF_S, decode_context_tokens=6e-8, prefill_context_tokens=5e-8, effective_context_tokens=1.2e-7)
"""A synthetic engine where a context token costs 6e-8 s per reader plus 1.2e-7 s once per step."""


@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_fit_recovers_the_sharing_coefficient_from_a_v2_trace(noise):
    trace = synthetic_trace(4000, coef_s=SHARING_COEF_S, shared_prefix_fraction=0.5, noise=noise, seed=21)
    assert trace.has_shared_context_per_step.mean() > 0.3
    model = StepLatencyModel(segments="none", outlier_threshold=None).fit(trace)
    assert "effective_context_tokens" not in model.fit_info_["unidentified_features"]
    coef = dict(zip(FEATURE_NAMES, model.coef_[0]))
    rtol = 1e-6 if noise == 0 else 0.1
    for name in ("effective_context_tokens", "decode_context_tokens", "decode_requests", "intercept"):
        assert coef[name] == pytest.approx(SHARING_COEF_S[name], rel=rtol), name


def test_a_v1_trace_cannot_identify_sharing_and_prices_context_per_request():
    v1 = synthetic_trace(2000, coef_s=SHARING_COEF_S, seed=22)
    model = StepLatencyModel(segments="none").fit(v1)
    coef = dict(zip(FEATURE_NAMES, model.coef_[0]))
    assert coef["effective_context_tokens"] == 0
    assert "effective_context_tokens" in model.fit_info_["unidentified_features"]
    total = SHARING_COEF_S["decode_context_tokens"] + SHARING_COEF_S["effective_context_tokens"]
    assert coef["decode_context_tokens"] == pytest.approx(total, rel=1e-6)


def test_version_1_model_files_load_with_sharing_held_at_zero(tmp_path):
    model = StepLatencyModel(segments=400).fit(piecewise_trace(400, seed=9))
    data = model.to_dict()
    old = json.loads(json.dumps(data))
    old["format_version"] = 1
    old["feature_names"] = old["feature_names"][:-1]
    old["identified_features"] = [n for n in old["identified_features"] if n != "effective_context_tokens"]
    for segment in old["segments"]:
        del segment["coef_s"]["effective_context_tokens"]
    (tmp_path / "v1.json").write_text(json.dumps(old))
    loaded = StepLatencyModel.from_json(tmp_path / "v1.json")
    assert not loaded.identified_[FEATURE_NAMES.index("effective_context_tokens")]
    shared = synthetic_trace(300, shared_prefix_fraction=0.5, seed=10)
    np.testing.assert_array_equal(loaded.predict(shared), model.predict(shared))
    old["feature_names"] = old["feature_names"][:-1]
    (tmp_path / "bad.json").write_text(json.dumps(old))
    with pytest.raises(ModelError, match="feature_names"):
        StepLatencyModel.from_json(tmp_path / "bad.json")


def test_a_version_1_model_file_predicts_by_its_version_1_coefficients(tmp_path):
    """A model file written before the effective-context term (format 1: eight features) loads with that term at
    0 and predicts exactly what its own coefficients say, on any trace."""
    data = json.loads(latency_model_path().read_text())
    data["format_version"] = 1
    data["feature_names"] = [name for name in data["feature_names"] if name != "effective_context_tokens"]
    for segment in data["segments"]:
        segment["coef_s"].pop("effective_context_tokens", None)
    data.pop("identified_features", None)
    path = tmp_path / "model-v1.json"
    path.write_text(json.dumps(data))
    model = StepLatencyModel.from_json(path)
    trace = read_trace(trace_path(HELD_OUT_TRACES[0]))
    p = trace.num_new_tokens.astype(float)
    c = trace.num_context_tokens.astype(float)
    load = np.add.reduceat(p, trace.step_starts)
    expected = np.zeros(trace.n_steps)
    for k in range(trace.n_steps):
        segment = 0 if data["boundary_new_tokens"] is None or load[k] < data["boundary_new_tokens"] else 1
        coef = data["segments"][segment]["coef_s"]
        s = slice(trace.step_offsets[k], trace.step_offsets[k + 1])
        prefill = trace.is_prefill[s]
        pp, cc = p[s], c[s]
        own = np.where(
            prefill,
            coef["prefill_new_tokens"] * pp + coef["prefill_context_tokens"] * cc + coef["prefill_new_tokens_squared"] * pp**2
            + coef["prefill_new_x_context_tokens"] * pp * cc + coef["prefill_requests"],
            coef["decode_context_tokens"] * cc + coef["decode_requests"],
        )
        expected[k] = coef["intercept"] + own.sum()
    np.testing.assert_allclose(model.predict(trace), expected, rtol=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_group_k_fold_gives_group_k_folds_fold_sizes(seed):
    """On random groups (a few to hundreds, sizes from one step to heavy runs), the folds keep each group whole,
    every step in exactly one fold, no fold empty, and per fold exactly the step counts of scikit-learn's
    GroupKFold (largest group first into the lightest fold); fewer groups than folds make fewer folds."""
    from sklearn.model_selection import GroupKFold

    rng = np.random.default_rng(seed)
    n_groups = int(rng.integers(2, 300)) if seed % 4 else int(rng.integers(2, 6))
    sizes = rng.integers(1, 1 + int(rng.choice([1, 5, 500])), size=n_groups)
    labels = rng.permutation(n_groups) * 7 + 3
    groups = rng.permutation(np.repeat(labels, sizes)) if seed % 2 else np.repeat(labels, sizes)
    n_folds = int(rng.integers(2, 8))
    folds = group_k_fold(groups, n_folds)
    k = min(n_folds, n_groups)
    assert len(folds) == k
    assert all(test.any() for test in folds)
    assert np.array_equal(np.sum(folds, axis=0), np.ones(groups.size))
    for test in folds:
        assert not (set(groups[test].tolist()) & set(groups[~test].tolist()))
    theirs = [test.size for _, test in GroupKFold(n_splits=k).split(groups, groups=groups)]
    assert [int(test.sum()) for test in folds] == theirs


def test_group_k_fold_of_one_group_has_no_fold_to_score_on():
    assert group_k_fold(np.zeros(50, dtype=int), 5) == []
    assert group_k_fold(np.zeros(0, dtype=int), 5) == []
    two = group_k_fold(np.array([0] * 300 + [1] * 472), 5)
    assert [int(test.sum()) for test in two] == [472, 300]


def test_group_k_fold_keeps_neighbouring_groups_of_equal_size_together():
    folds = group_k_fold(np.arange(100), 5)
    assert [np.flatnonzero(test).tolist() for test in folds] == [list(range(20 * i, 20 * i + 20)) for i in range(5)]


def test_two_runs_of_300_and_472_steps_fit_with_folds_by_run():
    """The trace a stranger tried: two runs, the first under half the steps. Old folds put both runs in fold 0
    and the boundary search raised ValueError (min() of no scored candidate)."""
    trace = concat_traces([synthetic_trace(300, run_id="a", noise=0.02, seed=1), synthetic_trace(472, run_id="b", noise=0.02, seed=2)])
    search = StepLatencyModel().fit(trace).fit_info_["boundary_search"]
    assert search["fold_grouping"] == "run" and search["n_folds"] == 2 and "none" in search["candidates"]
    assert "reason" not in search


def test_a_boundary_search_with_nothing_to_score_falls_back_to_none_with_a_reason(tmp_path):
    """One fold group (every step alike) or one run of one kind of step leaves no fold to train on:
    the boundary is none, the reason is stated in the model file and survives saving and loading."""
    trace = synthetic_trace(60, max_batch_size=1, prefill_fraction=0.0, seed=3)
    trace.num_context_tokens[:] = 7
    model = StepLatencyModel().fit(trace)
    search = model.fit_info_["boundary_search"]
    assert model.boundary_ is None and search["chosen"] == "none" and search["n_folds"] == 0
    assert "1 time-block group" in search["reason"]
    model.to_json(tmp_path / "m.json")
    loaded = StepLatencyModel.from_json(tmp_path / "m.json")
    assert loaded.boundary_ is None and loaded.fit_info_["boundary_search"]["reason"] == search["reason"]
    np.testing.assert_array_equal(loaded.predict(trace), model.predict(trace))
    shipped = StepLatencyModel.from_json(latency_model_path())
    assert "reason" not in shipped.fit_info_["boundary_search"] and shipped.boundary_ == 39.0


def test_fold_groups_count_only_the_runs_left_after_warm_up():
    runs = concat_traces([synthetic_trace(200, run_id="a", noise=0.02, seed=1), synthetic_trace(200, run_id="b", noise=0.02, seed=2)])
    runs.extra["is_warmup"] = runs.run_id == "a"
    search = StepLatencyModel().fit(runs).fit_info_["boundary_search"]
    assert search["fold_grouping"] == "time_block" and search["n_folds"] == 5


def test_a_trace_of_only_warm_up_steps_is_refused_in_one_line():
    trace = synthetic_trace(50, seed=1)
    trace.extra["is_warmup"] = np.ones(trace.n_slices, dtype=bool)
    with pytest.raises(LlmvisorError, match="too few steps to fit \\(0 of 50 left after dropping 50 warm-up"):
        StepLatencyModel().fit(trace)


def test_a_misspelled_coefficient_in_a_model_file_is_named_with_the_closest_feature(tmp_path):
    data = StepLatencyModel(segments="none").fit(piecewise_trace(200, seed=3)).to_dict()
    data["segments"][0]["coef_s"]["decode_context_tokenz"] = data["segments"][0]["coef_s"].pop("decode_context_tokens")
    (tmp_path / "typo.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match=r"typo.json: segments\[0\]: unknown feature decode_context_tokenz; did you mean decode_context_tokens"):
        StepLatencyModel.from_json(tmp_path / "typo.json")
