"""Fair-sharing core: VTC counters, lift and weights, quotas, admission decisions, costs, metrics, config."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.core.attribution import StepAttributor, own_terms_s
from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S, synthetic_trace
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.policy import (
    ENV_CONFIG,
    AdmissionController,
    FairnessConfig,
    FairShare,
    Quota,
    SlidingWindowQuota,
    TokenCost,
    VirtualTokenCounter,
    jain_index,
    max_min_ratio,
)

BASE = [DEFAULT_COEF_S[n] for n in FEATURE_NAMES]
HEAVY = [c * 3 for c in BASE]


def fixed_model(coef_sets, boundary=None) -> StepLatencyModel:
    return StepLatencyModel.from_coefficients([dict(zip(FEATURE_NAMES, c)) for c in coef_sets], boundary)


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "model.json"
    fixed_model([BASE]).to_json(path)
    return str(path)


# ---------------------------------------------------------------------------------------------- VTC


def test_charge_adds_cost_over_weight_to_the_counter_and_raw_cost_to_served():
    vtc = VirtualTokenCounter({"gold": 4.0}, default_weight=1.0)
    vtc.charge("gold", 8.0)
    vtc.charge("free", 8.0)
    assert vtc.counter == {"gold": 2.0, "free": 8.0}
    assert vtc.served == {"gold": 8.0, "free": 8.0}


def test_returning_tenant_is_lifted_to_the_lowest_backlogged_counter():
    vtc = VirtualTokenCounter()
    for tenant in ("a", "b"):
        vtc.arrive(tenant)
    vtc.charge("a", 10.0)
    vtc.charge("b", 30.0)
    vtc.arrive("c")  # new tenant at 0: lifted to min(a, b) = 10, not to b's 30
    assert vtc.counter["c"] == 10.0
    assert vtc.num_lifts == 1
    vtc.charge("c", 50.0)
    vtc.leave("c")
    vtc.arrive("c")  # c is above every backlogged counter: never lowered
    assert vtc.counter["c"] == 60.0


def test_lift_ignores_the_returning_tenants_own_backlog_and_requeues_do_not_lift():
    vtc = VirtualTokenCounter()
    vtc.arrive("a")
    vtc.arrive("a")  # still backlogged: a second arrival is not a return
    vtc.arrive("b")
    vtc.charge("b", 5.0)
    vtc.leave("b")
    vtc.charge("a", 20.0)
    vtc.requeue("b")  # a preempted request coming back is not a return
    assert vtc.counter["b"] == 5.0
    vtc.leave("b")
    vtc.arrive("b")  # a real return
    assert vtc.counter["b"] == 20.0


def test_with_no_one_backlogged_a_returning_tenant_is_lifted_to_the_last_departed_counter():
    vtc = VirtualTokenCounter()
    vtc.arrive("a")
    vtc.charge("a", 100.0)
    vtc.leave("a")
    assert vtc.last_departed == 100.0
    vtc.arrive("idle")
    assert vtc.counter["idle"] == 100.0


def test_lowest_uses_reservations_and_breaks_ties_by_first_seen():
    vtc = VirtualTokenCounter()
    for tenant in ("x", "y", "z"):
        vtc.arrive(tenant)
    assert vtc.lowest(["z", "y", "x"]) == "x"
    vtc.reserve("x", 3.0)
    assert vtc.lowest(["z", "y", "x"]) == "y"
    vtc.clear_reservations()
    assert vtc.lowest(["z", "x"]) == "x"
    assert vtc.lowest([]) is None


def test_leaving_more_often_than_joining_is_an_error():
    vtc = VirtualTokenCounter()
    vtc.arrive("a")
    vtc.leave("a")
    with pytest.raises(LlmvisorError):
        vtc.leave("a")


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=2, max_size=4),
    costs=st.lists(st.floats(0.1, 5.0), min_size=50, max_size=300),
    data=st.data(),
)
def test_backlogged_tenants_weighted_counters_stay_within_one_request_of_each_other(weights, costs, data):
    """VTC's bound: serving the lowest counter next keeps every backlogged pair within max cost / min weight."""
    tenants = [f"t{i}" for i in range(len(weights))]
    vtc = VirtualTokenCounter(dict(zip(tenants, weights)))
    for tenant in tenants:
        vtc.arrive(tenant)
        vtc.arrive(tenant)
    bound = max(costs) / min(weights)
    for cost in costs:
        tenant = vtc.lowest(tenants)
        vtc.leave(tenant)
        vtc.charge(tenant, cost)
        vtc.arrive(tenant)  # still backlogged: a new request replaces the one served
        counters = [vtc.counter[t] for t in tenants]
        assert max(counters) - min(counters) <= bound + 1e-9
    # over the run, service is in proportion to weight, up to one request per tenant
    served_per_weight = [vtc.served[t] / vtc.weight(t) for t in tenants]
    assert max(served_per_weight) - min(served_per_weight) <= bound + 1e-9


# ---------------------------------------------------------------------------------------------- quotas


def test_sliding_window_counts_only_charges_inside_the_window():
    quota = SlidingWindowQuota(Quota(budget_s=1.0, window_s=10.0))
    quota.add(0.0, 0.6)
    quota.add(5.0, 0.3)
    assert quota.used_s(5.0) == pytest.approx(0.9)
    assert not quota.over_budget(5.0)
    quota.add(6.0, 0.2)
    assert quota.over_budget(6.0)
    assert quota.used_s(10.0) == pytest.approx(0.5)  # the charge at t=0 left the window at t=10
    assert not quota.over_budget(10.0)
    assert quota.used_s(100.0) == 0.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 2)), min_size=1, max_size=60), st.floats(0.5, 30))
def test_sliding_window_matches_a_brute_force_sum(charges, window_s):
    charges = sorted(charges)
    quota = SlidingWindowQuota(Quota(budget_s=1.0, window_s=window_s))
    for i, (t, seconds) in enumerate(charges):
        quota.add(t, seconds)
        expected = sum(s for u, s in charges[: i + 1] if t - window_s < u <= t)
        assert quota.used_s(t) == pytest.approx(expected, abs=1e-9)


def quota_share(work_conserving: bool, model_path: str) -> FairShare:
    config = FairnessConfig.from_dict(
        {"cost": "tokens", "model": model_path, "quotas": {"capped": {"budget_s": 1.0, "window_s": 60}}, "work_conserving": work_conserving}
    )
    share = FairShare(config)
    for tenant in ("capped", "free"):
        share.arrive(tenant)
    return share


def test_over_budget_tenant_waits_even_with_the_lowest_counter(model_path):
    share = quota_share(False, model_path)
    share.vtc.charge("free", 100.0)
    assert share.choose(["capped", "free"], now_s=0.0) == "capped"
    share.quota_of("capped").add(0.0, 1.5)
    assert share.choose(["capped", "free"], now_s=1.0) == "free"
    assert share.choose(["capped"], now_s=1.0) is None  # strict: waits although nothing else would run
    assert share.num_quota_waits == 1
    assert share.choose(["capped"], now_s=61.0) == "capped"  # its charge left the window


def test_work_conserving_admits_over_budget_tenants_only_when_no_one_within_budget_waits(model_path):
    share = quota_share(True, model_path)
    share.quota_of("capped").add(0.0, 1.5)
    assert share.choose(["capped", "free"], now_s=1.0) == "free"
    assert share.choose(["capped"], now_s=1.0) == "capped"
    assert share.num_work_conserving == 1


def test_quotas_are_charged_attributed_seconds_even_with_the_token_cost(model_path):
    share = quota_share(False, model_path)
    p, c = np.array([1.0, 1.0]), np.array([100.0, 300.0])
    charge = share.charge_step(["capped", "free"], p, c, np.zeros(2, bool), np.ones(2, bool), 0.05, now_s=3.0)
    assert charge.cost == {"capped": 2.0, "free": 2.0}
    assert sum(charge.attributed_s.values()) == pytest.approx(0.05)
    assert share.quota_of("capped").used_s(3.0) == pytest.approx(charge.attributed_s["capped"])
    assert charge.attributed_s["free"] > charge.attributed_s["capped"]  # longer context, larger share


# ---------------------------------------------------------------------------------------------- admission


WITH_EFFECTIVE_CONTEXT = [c if name != "effective_context_tokens" else 6e-07 for name, c in zip(FEATURE_NAMES, BASE)]


@pytest.mark.parametrize("coef_sets,boundary", [([BASE], None), ([BASE, HEAVY], 6), ([WITH_EFFECTIVE_CONTEXT], None)])
@settings(max_examples=40, deadline=None)
@given(contexts=st.lists(st.integers(0, 4000), min_size=1, max_size=12))
def test_closed_form_decode_step_matches_the_attributors_prediction(coef_sets, boundary, contexts):
    model = fixed_model(coef_sets, boundary)
    controller = AdmissionController(model, tpot_slo_s=None)
    c = np.array(contexts, dtype=np.float64)
    n = c.size
    expected = StepAttributor(model).predict_step_s(np.ones(n), c, np.zeros(n, bool))
    assert controller.decode_step_s(n, float(c.sum())) == pytest.approx(expected, rel=1e-12)


def test_prefill_cost_is_the_sum_of_its_chunks_own_terms():
    model = fixed_model([BASE])
    controller = AdmissionController(model, tpot_slo_s=None, max_chunk_tokens=512)
    coef = model.coef_[0]
    whole = own_terms_s(coef, [300], [0], [True])[0]
    assert controller.prefill_cost_s(300) == pytest.approx(whole)
    chunks = own_terms_s(coef, [512, 512, 176], [100, 612, 1124], [True] * 3).sum()
    assert controller.prefill_cost_s(1300, num_cached_tokens=100) == pytest.approx(chunks)
    assert controller.prefill_cost_s(100, num_cached_tokens=100) == 0.0


def test_admission_defers_a_request_that_pushes_predicted_tpot_past_the_slo():
    model = fixed_model([BASE])
    probe = AdmissionController(model, tpot_slo_s=None)
    before = probe.decide(8, 8 * 1000, num_prompt_tokens=200, output_tokens=50)
    assert before.decode_step_after_s > before.decode_step_before_s
    assert before.predicted_tpot_s == pytest.approx(before.decode_step_after_s + before.prefill_cost_s / 50)
    slo = (before.predicted_tpot_s + before.decode_step_before_s) / 2  # between: today's step fits, the new one does not
    controller = AdmissionController(model, tpot_slo_s=slo)
    assert not controller.decide(8, 8 * 1000, num_prompt_tokens=200, output_tokens=50).admit
    small = controller.decide(1, 100, num_prompt_tokens=10, output_tokens=50)
    assert small.admit and small.predicted_tpot_s <= slo
    assert controller.decide(0, 0, num_prompt_tokens=10**6, output_tokens=1).admit  # never deferred on an idle engine


def test_longer_prompts_and_contexts_predict_more_time_per_output_token():
    controller = AdmissionController(fixed_model([BASE]), tpot_slo_s=1.0)
    short = controller.decide(16, 16 * 200, num_prompt_tokens=100, output_tokens=64).predicted_tpot_s
    long = controller.decide(16, 16 * 200, num_prompt_tokens=3000, output_tokens=64).predicted_tpot_s
    assert long > short


def test_choose_stops_at_a_deferred_head_instead_of_skipping_to_cheaper_tenants(model_path):
    share = FairShare(FairnessConfig.from_dict({"cost": "tokens", "model": model_path, "tpot_slo_s": 0.01}))
    for tenant in ("expensive", "cheap"):
        share.arrive(tenant)
    share.vtc.charge("cheap", 5.0)
    deferred = share.admission.decide(8, 8000, 4000, 0, 4)
    assert not deferred.admit
    assert share.choose(["expensive", "cheap"], 0.0, decide=lambda tenant: deferred) is None
    assert share.num_deferred == 1
    fits = share.admission.decide(0, 0, 10, 0, 4)
    assert share.choose(["expensive", "cheap"], 0.0, decide=lambda tenant: fits) == "expensive"


def test_admission_on_a_model_that_predicts_low_admits_less_with_a_prediction_factor():
    """The engine runs at BASE, the model predicts 15% low; with the factor admission stops violating the SLO."""
    engine = AdmissionController(fixed_model([BASE]), tpot_slo_s=None)
    biased = fixed_model([[c * 0.85 for c in BASE]])
    slo = engine.decide(8, 8 * 1000, num_prompt_tokens=200, output_tokens=50).predicted_tpot_s
    raw = AdmissionController(biased, tpot_slo_s=slo, prediction_factor=1.0)
    calibrated = AdmissionController(biased, tpot_slo_s=slo, prediction_factor=1 / 0.85)
    outcomes = {"raw": [0, 0], "calibrated": [0, 0]}
    for running in range(1, 16):
        for context in (200, 600, 1000, 1400):
            for prompt in (50, 200, 800):
                true_tpot = engine.decide(running, running * context, prompt, 0, 50).predicted_tpot_s
                for name, controller in (("raw", raw), ("calibrated", calibrated)):
                    decision = controller.decide(running, running * context, prompt, 0, 50)
                    assert decision.model_tpot_s == pytest.approx(true_tpot * 0.85)
                    if decision.admit:
                        outcomes[name][0] += 1
                        outcomes[name][1] += true_tpot > slo * (1 + 1e-9)
    assert outcomes["calibrated"][0] < outcomes["raw"][0]
    assert outcomes["raw"][1] > 0 and outcomes["calibrated"][1] == 0


def test_prediction_factor_comes_from_the_config_or_else_the_fit_residuals(tmp_path):
    fitted = StepLatencyModel().fit(synthetic_trace(1500, noise=0.08, seed=1))
    r90 = fitted.fit_info_["train_rel_err_p90"]
    controller = AdmissionController(fitted, tpot_slo_s=0.05)
    assert controller.prediction_factor == pytest.approx(1 / (1 - r90)) and controller.prediction_factor > 1
    assert "fit residuals" in controller.prediction_factor_source
    decision = controller.decide(4, 4000, 100, 0, 10)
    assert decision.predicted_tpot_s == pytest.approx(decision.model_tpot_s / (1 - r90))
    assert AdmissionController(fixed_model([BASE]), tpot_slo_s=0.05).prediction_factor == 1.0  # no fit residuals
    fitted_path = tmp_path / "fitted.json"
    fitted.to_json(fitted_path)
    share = FairShare(FairnessConfig.from_dict({"cost": "tokens", "model": str(fitted_path), "tpot_slo_s": 0.05, "tpot_prediction_factor": 1.3}))
    assert share.admission.prediction_factor == 1.3 and share.admission.prediction_factor_source == "configured"
    assert FairnessConfig.from_dict({"tpot_prediction_factor": 1.3}).as_dict()["tpot_prediction_factor"] == 1.3
    for bad in (0, -1, "x"):
        with pytest.raises(LlmvisorError, match="tpot_prediction_factor must be a positive number"):
            FairnessConfig.from_dict({"tpot_prediction_factor": bad})


# ---------------------------------------------------------------------------------------------- charging


def test_token_cost_counts_prompt_tokens_once_and_output_tokens_twice():
    cost = TokenCost()
    p = np.array([128, 64, 1, 1])
    prefill = np.array([True, True, False, False])
    samples = np.array([False, True, True, True])  # the first chunk does not end its prompt; the second does
    assert cost.slice_costs(p, prefill, samples).tolist() == [128.0, 66.0, 2.0, 2.0]


@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 4000), st.booleans(), st.integers(1, 512)), min_size=1, max_size=16),
    measured=st.floats(1e-3, 2.0),
)
def test_attributed_charges_are_the_steps_shares_and_sum_to_its_measured_time(batch, measured):
    model = fixed_model([BASE])
    share = FairShare(FairnessConfig(cost="attributed"), model)
    tenants = [t for t, *_ in batch]
    c = np.array([ctx for _, ctx, _, _ in batch], dtype=np.float64)
    prefill = np.array([pre for _, _, pre, _ in batch])
    p = np.where(prefill, [n for *_, n in batch], 1).astype(np.float64)
    shares = StepAttributor(model).attribute(p, c, prefill, measured).copy()
    share.vtc.reserve("a", 99.0)
    charge = share.charge_step(tenants, p, c, prefill, np.ones(len(batch), bool), measured, 0.0)
    for tenant in set(tenants):
        expected = sum(s for t, s in zip(tenants, shares) if t == tenant)
        assert charge.cost[tenant] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert share.vtc.counter[tenant] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert math.fsum(charge.cost.values()) == pytest.approx(measured, rel=1e-12)
    assert share.vtc.reserved == {}  # the step's measured charge replaces this pass's reservations


def test_tenants_reading_one_shared_prefix_are_charged_for_it_once_between_them():
    """Three decodes of tenant "docs" read one 1,536-token prefix (prefix caching); "solo" reads its own 1,536
    tokens. With a model that prices distinct context per step, the sharers pay the prefix once between them."""
    coef = dict(zip(FEATURE_NAMES, BASE))
    coef["decode_context_tokens"] = 0.0
    coef["effective_context_tokens"] = 2e-6
    model = StepLatencyModel.from_coefficients([coef])
    tenants = ["docs", "docs", "docs", "solo"]
    p = np.ones(4)
    c = np.full(4, 1600.0)
    prefill = np.zeros(4, bool)
    effective = np.array([1536 / 3 + 64] * 3 + [1600.0])
    measured = StepAttributor(model).predict_step_s(p, c, prefill, effective)
    shared = FairShare(FairnessConfig(cost="attributed"), model).charge_step(tenants, p, c, prefill, np.ones(4, bool), measured, 0.0, effective_context_tokens=effective)
    unshared = FairShare(FairnessConfig(cost="attributed"), model).charge_step(tenants, p, c, prefill, np.ones(4, bool), measured, 0.0)
    assert math.fsum(shared.cost.values()) == pytest.approx(measured, rel=1e-12)
    per_docs_request = shared.cost["docs"] / 3
    assert per_docs_request < shared.cost["solo"]
    assert shared.cost["solo"] - per_docs_request == pytest.approx(2e-6 * (1600 - (1536 / 3 + 64)), rel=1e-9)
    assert shared.cost["docs"] < unshared.cost["docs"]


def test_reservation_is_the_prefill_prediction_in_the_configured_unit(model_path):
    tokens = FairShare(FairnessConfig(cost="tokens"))
    assert tokens.reservation(100, 20) == 80 + 2.0
    attributed = FairShare(FairnessConfig(cost="attributed", model=model_path))
    assert attributed.reservation(100) == pytest.approx(attributed.admission.prefill_cost_s(100))


# ---------------------------------------------------------------------------------------------- metrics


def test_jain_index_and_max_min_ratio_on_known_cases():
    assert jain_index([3, 3, 3]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([1, 2]) == pytest.approx(9 / 10)
    assert max_min_ratio([2, 3]) == pytest.approx(1.5)
    assert max_min_ratio([0, 1]) == math.inf
    assert math.isnan(jain_index([]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=10), st.floats(1e-3, 1e3))
def test_jain_index_is_bounded_and_scale_invariant(values, scale):
    j = jain_index(values)
    n = len(values)
    assert 1 / n - 1e-12 <= j <= 1 + 1e-12
    if sum(values) > 0:
        assert jain_index([v * scale for v in values]) == pytest.approx(j, rel=1e-9)


# ---------------------------------------------------------------------------------------------- config


def test_config_from_json_toml_and_environment(tmp_path, model_path):
    data = {
        "cost": "tokens",
        "model": model_path,
        "weights": {"gold": 2},
        "quotas": {"free": {"budget_s": 5, "window_s": 60}},
        "tpot_slo_s": 0.2,
        "work_conserving": True,
    }
    json_path = tmp_path / "fair.json"
    json_path.write_text(json.dumps(data))
    toml_path = tmp_path / "fair.toml"
    toml_path.write_text(
        f'cost = "tokens"\nmodel = "{model_path}"\ntpot_slo_s = 0.2\nwork_conserving = true\n'
        '[weights]\ngold = 2\n[quotas.free]\nbudget_s = 5\nwindow_s = 60\n'
    )
    for config in (
        FairnessConfig.from_file(json_path),
        FairnessConfig.from_file(toml_path),
        FairnessConfig.from_env({ENV_CONFIG: str(json_path)}),
        FairnessConfig.from_env({ENV_CONFIG: json.dumps(data)}),
    ):
        assert config.cost == "tokens"
        assert config.weight("gold") == 2.0 and config.weight("other") == 1.0
        assert config.quota("free") == Quota(5.0, 60.0) and config.quota("gold") is None
        assert config.tpot_slo_s == 0.2 and config.work_conserving
        assert config.needs_model
    assert FairnessConfig.from_env({}) == FairnessConfig()


@pytest.mark.parametrize(
    "data,message",
    [
        ({"cost": "dollars"}, "cost must be one of"),
        ({"weights": {"a": 0}}, "weights.a must be a positive number"),
        ({"weights": {"a": True}}, "weights.a must be a positive number"),
        ({"quotas": {"a": {"budget_s": 1}}}, "quotas.a must be"),
        ({"quotas": {"a": {"budget_s": 1, "window_s": 0}}}, "quotas.a.window_s must be a positive number"),
        ({"tpot_slo_s": -1}, "tpot_slo_s must be a positive number"),
        ({"work_conserving": "yes"}, "work_conserving must be true or false"),
        ({"rule": "fair"}, "rule must be one of"),
        ({"slo": 1}, "unknown fairness config key(s) slo"),
        ([1, 2], "must be an object"),
    ],
)
def test_config_rejections_name_the_key(data, message):
    with pytest.raises(LlmvisorError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FairnessConfig.from_dict(data, source="fair.json")


def test_unreadable_config_and_missing_model_are_one_line_errors(tmp_path):
    bad = tmp_path / "fair.json"
    bad.write_text("{nope")
    with pytest.raises(LlmvisorError, match="not valid JSON"):
        FairnessConfig.from_file(bad)
    with pytest.raises(LlmvisorError, match="cannot read"):
        FairnessConfig.from_file(tmp_path / "absent.json")
    with pytest.raises(LlmvisorError, match="need a model"):
        FairShare(FairnessConfig(cost="attributed", model=str(tmp_path / "absent-model.json")))
    assert FairShare(FairnessConfig(cost="tokens")).model is None  # the token cost alone needs no model
