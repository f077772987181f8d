"""The fairness experiment's analysis on a run built by hand: windows, backlog, attributed time, latencies."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S
from llmvisor.core.trace import TraceWriter
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.experiment import (
    admission,
    alone_workload,
    analyse_run,
    goals,
    model_free,
    model_free_goals,
    report_sections,
    workload_tenants,
)


def fixed_model() -> StepLatencyModel:
    return StepLatencyModel.from_coefficients([dict(DEFAULT_COEF_S)])


@pytest.fixture
def run(tmp_path):
    """40 steps, 0.1 s apart, 0.08 s each. a-0 and b-0 decode throughout (a over a 10x longer context); a-1
    waits forever, b-1 waits until t=2 and then decodes: a is backlogged throughout, b only before t=2."""
    trace_path = tmp_path / "trace.jsonl"
    t0_wall = 1000.0
    step_return, step_tokens = [], []
    with TraceWriter(trace_path) as writer:
        for k in range(40):
            t = 0.1 * k
            slices = [("a-0-xxxxxxxx", "a", 1000 + k), ("b-0-yyyyyyyy", "b", 100 + k)]
            if t >= 2.0:
                slices.append(("b-1-zzzzzzzz", "b", 50 + k))
            writer.write_step(
                [
                    {
                        "run_id": "r",
                        "step_id": k,
                        "step_latency_s": 0.08,
                        "request_id": rid,
                        "tenant": tenant,
                        "num_new_tokens": 1,
                        "num_context_tokens": ctx,
                        "phase": "decode",
                        "timestamp_s": t0_wall + t,
                    }
                    for rid, tenant, ctx in slices
                ]
            )
            step_return.append(t + 0.08)
            step_tokens.append([1, len(slices) - 1])
    requests = [
        {"request_id": "a-0", "tenant": "a", "arrival_s": 0.0, "submitted_s": 0.0, "first_token_s": 0.08, "finish_s": 3.98, "output_tokens": 40},
        {"request_id": "b-0", "tenant": "b", "arrival_s": 0.0, "submitted_s": 0.0, "first_token_s": 0.08, "finish_s": 3.98, "output_tokens": 40},
        {"request_id": "a-1", "tenant": "a", "arrival_s": 0.0, "submitted_s": 0.0, "first_token_s": None, "finish_s": None, "output_tokens": 0},
        {"request_id": "b-1", "tenant": "b", "arrival_s": 0.0, "submitted_s": 0.0, "first_token_s": 2.08, "finish_s": None, "output_tokens": 20},
    ]
    return {
        "policy": "attributed",
        "tenants": ["a", "b"],
        "trace": str(trace_path),
        "first_step": 0,
        "t0_wall_s": t0_wall,
        "end_s": 4.0,
        "requests": requests,
        "step_return_s": step_return,
        "step_output_tokens": step_tokens,
        "engine_start_s": 1.0,
        "num_arrivals": 4,
        "waiting_at_end": 1,
        "recorder_overhead": {},
    }


def test_windows_split_measured_time_by_shares_and_find_backlogged_tenants(run):
    out = analyse_run(run, fixed_model(), window_s=1.0, warmup_s=0.0)
    windows = out["windows"]
    assert [w["start_s"] for w in windows] == [0.0, 1.0, 2.0, 3.0]
    for w in windows:
        assert sum(w["attributed_s"].values()) == pytest.approx(10 * 0.08)  # every measured second, billed once
        assert w["attributed_s"]["a"] > w["attributed_s"]["b"] or w["start_s"] >= 2.0
    assert [w["backlogged"] for w in windows] == [["a", "b"], ["a", "b"], ["a"], ["a"]]
    ratio = windows[0]["attributed_s"]["a"] / windows[0]["attributed_s"]["b"]
    assert windows[0]["engine_time_max_min"] == pytest.approx(ratio)
    assert windows[2]["engine_time_max_min"] is None  # one backlogged tenant: no fairness figure
    assert windows[3]["output_tokens"] == {"a": 10.0, "b": 20.0}
    assert windows[3]["token_service"] == {"a": 20.0, "b": 40.0}  # decode tokens count as output tokens x2
    summary = out["summary"]
    assert summary["backlogged_throughout"] == ["a"]
    assert summary["engine_time_max_min"] is None and summary["jain"] is None
    assert summary["window_engine_time_max_min"]["median"] == pytest.approx(np.median([windows[0]["engine_time_max_min"], windows[1]["engine_time_max_min"]]))
    assert summary["ttft_s"]["b"]["n"] == 2 and summary["ttft_s"]["b"]["p50"] == pytest.approx((0.08 + 2.08) / 2)
    assert summary["tpot_s"]["a"]["p50"] == pytest.approx(3.9 / 39)
    assert summary["requests_never_started"] == {"a": 1, "b": 0}
    assert summary["output_tokens_per_s"] == pytest.approx((40 + 60) / 4.0)
    assert summary["engine_busy_fraction"] == pytest.approx(0.8)


def test_goals_compare_attributed_vtc_with_the_baselines():
    def summary(ratio, jain, tokens_per_s):
        return {"summary": {"engine_time_max_min": ratio, "jain": jain, "output_tokens_per_s": tokens_per_s}}

    judged = goals({"fcfs": summary(1.8, 0.92, 100.0), "tokens": summary(1.7, 0.93, 99.0), "attributed": summary(1.1, 0.99, 97.0)})
    assert judged["attributed_vtc_within_max_min"] and judged["attributed_vtc_jain_met"]
    assert judged["fcfs_gap_larger"] and judged["tokens_gap_larger"]
    assert judged["throughput_change_vs_fcfs"] == pytest.approx(-0.03) and judged["throughput_within_goal"]
    judged = goals({"fcfs": summary(1.8, 0.92, 100.0), "attributed": summary(1.3, 0.94, 90.0)})
    assert not judged["attributed_vtc_within_max_min"] and not judged["attributed_vtc_jain_met"] and not judged["throughput_within_goal"]


def test_report_sections_render(run):
    analysed = {"attributed": analyse_run(run, fixed_model(), window_s=1.0, warmup_s=0.0)}
    result = {
        "setup": {"workload": {"tenants": workload_tenants(2, rate_rps=1, history_tokens=512, n_conversations=1, prompt_tokens=8, output_tokens=8)}, "window_s": 1.0, "warmup_s": 0.0},
        "policies": analysed,
    }
    sections = report_sections(json.loads(json.dumps(result)))
    assert [heading for heading, _ in sections] == ["Fairness: FCFS vs token VTC vs attributed VTC", "Fairness over time"]
    assert "attributed VTC" in sections[0][1] and "<img" in sections[1][1]


def _summary(finished: dict, interval=(10.0, 90.0), backlogged=None) -> dict:
    return {"interval_s": list(interval), "requests_finished": finished, "backlogged_throughout": list(backlogged if backlogged is not None else finished)}


def test_model_free_service_divides_completions_under_the_policy_by_completions_alone():
    alone = {"a": _summary({"a": 800}), "b": _summary({"b": 400}, interval=(10.0, 50.0))}  # 10/s and 10/s alone
    fair = model_free(_summary({"a": 400, "b": 400}), alone)  # 5/s each: half the engine each
    assert fair["alone_completions_per_s"] == {"a": pytest.approx(10.0), "b": pytest.approx(10.0)}
    assert fair["normalised_service"] == {"a": pytest.approx(0.5), "b": pytest.approx(0.5)}
    assert fair["max_min"] == pytest.approx(1.0) and fair["jain"] == pytest.approx(1.0)
    skewed = model_free(_summary({"a": 600, "b": 200}), alone)
    assert skewed["max_min"] == pytest.approx(3.0) and skewed["jain"] == pytest.approx(0.8)
    partly = model_free(_summary({"a": 600, "b": 200}, backlogged=["a"]), alone)  # b not backlogged: not compared
    assert partly["tenants_compared"] == ["a"] and partly["max_min"] is None


def test_alone_workload_keeps_the_tenant_and_offers_the_total_rate():
    workload = {"tenants": workload_tenants(2, rate_rps=4.0, history_tokens=64, n_conversations=2, prompt_tokens=8, output_tokens=8, shared_documents=1), "duration_s": 5.0, "seed": 3}
    alone = alone_workload(workload, "shared")
    assert [t["name"] for t in alone["tenants"]] == ["shared"] and alone["tenants"][0]["rate_rps"] == 12.0
    assert alone["tenants"][0]["n_conversations"] == 1 and alone["seed"] == 3
    with pytest.raises(LlmvisorError, match="no tenant 'x'"):
        alone_workload(workload, "x")


def _slo_run(tpots: dict, name: str) -> dict:
    requests = []
    for tenant, values in tpots.items():
        for k, tpot in enumerate(values):
            requests.append({"request_id": f"{tenant}-{k}", "tenant": tenant, "arrival_s": 1.0, "first_token_s": 20.0, "finish_s": 20.0 + 10 * tpot, "output_tokens": 11})
    requests.append({"request_id": "late", "tenant": "a", "arrival_s": 1.0, "first_token_s": 95.0, "finish_s": 96.0, "output_tokens": 11})  # outside
    return {"name": name, "tenants": list(tpots), "requests": requests}


def test_admission_reports_slo_attainment_goodput_and_deferrals():
    without = _slo_run({"a": [0.03, 0.07, 0.09], "b": [0.04, 0.06]}, "attributed")
    with_slo = _slo_run({"a": [0.03, 0.04], "b": [0.045, 0.02, 0.01]}, "attributed-slo")
    with_slo["scheduler_state"] = {"deferral_waits_s": {"a": [0.5, 1.5]}, "deferred_waiting": {"b": 1}, "num_deferred": 9, "tpot_prediction_factor": 1.2}
    runs = {"attributed": without, "attributed-slo": with_slo}
    out = admission({"summary": _summary({})}, {"summary": _summary({})}, runs, 0.05)
    assert out["without"]["tenants"]["a"]["requests"] == 3 and out["without"]["tenants"]["a"]["met_slo_fraction"] == pytest.approx(1 / 3)
    assert out["without"]["all"]["met_slo_fraction"] == pytest.approx(2 / 5)
    assert out["without"]["all"]["goodput_tokens_per_s"] == pytest.approx(2 * 11 / 80)
    assert out["with"]["all"]["met_slo_fraction"] == 1.0 and out["with"]["all"]["goodput_tokens_per_s"] == pytest.approx(5 * 11 / 80)
    assert out["deferrals"]["a"] == {"requests_deferred": 2, "still_deferred_at_end": 0, "wait_s": {"n": 2, "p50": 1.0, "p99": pytest.approx(1.49)}}
    assert out["deferrals"]["b"]["requests_deferred"] == 1 and out["deferrals"]["b"]["still_deferred_at_end"] == 1
    assert out["goals"] == {"p99_tpot_within_slo": True, "goodput_not_below_without": True}
    worse = admission({"summary": _summary({})}, {"summary": _summary({})}, {"attributed": with_slo, "attributed-slo": {**without, "scheduler_state": {}}}, 0.05)
    assert worse["goals"] == {"p99_tpot_within_slo": False, "goodput_not_below_without": False}


def test_model_free_goal_judges_attributed_vtc():
    judged = model_free_goals({"fcfs": {"model_free": {"max_min": 2.5}}, "attributed": {"model_free": {"max_min": 1.1}}})
    assert judged["attributed_model_free_within_max_min"] and judged["fcfs_model_free_max_min"] == 2.5
    assert model_free_goals({"attributed": {"model_free": {"max_min": 1.3}}})["attributed_model_free_within_max_min"] is False


def test_admission_repeated_over_seeds_runs_both_arms_per_seed_with_the_given_factor(tmp_path, monkeypatch):
    """Each seed runs attributed VTC without and with admission on its own arrivals and engine seed, the SLO run
    with the held-out factor; the figures over seeds are means with Student-t intervals of the per-seed figures."""
    from scipy import stats

    from llmvisor.fairness import experiment

    tpots = {0: ([0.03, 0.07, 0.09], [0.03, 0.04]), 1: ([0.04, 0.06, 0.08], [0.02, 0.045, 0.06]), 2: ([0.02, 0.07], [0.03])}
    specs = []

    def fake_run_policy(spec, log_path):
        specs.append(spec)
        seed = spec["workload"]["seed"]
        assert spec["engine"]["seed"] == seed
        without, with_ = tpots[seed]
        run = _slo_run({"a": without if spec["tpot_slo_s"] is None else with_}, spec["name"])
        if spec["tpot_slo_s"] is not None:
            run["scheduler_state"] = {"tpot_prediction_factor": spec["tpot_prediction_factor"], "num_deferred": 1}
        return run

    monkeypatch.setattr(experiment, "run_policy", fake_run_policy)
    monkeypatch.setattr(experiment, "analyse_run", lambda run, model, **kw: {"summary": _summary({})})
    result = experiment.run_admission_experiment(
        tmp_path / "out", latency_model_path=None, engine_dir=tmp_path, engine={"max_num_seqs": 32}, workload={"tenants": [], "duration_s": 90.0},
        seeds=[0, 1, 2], tpot_slo_s=0.05, tpot_prediction_factor=1.058, prediction_factor_source="held-out", window_s=10.0, warmup_s=10.0)
    assert [(s["workload"]["seed"], s["name"]) for s in specs] == [(k, n) for k in (0, 1, 2) for n in ("attributed", "attributed-slo")]
    assert [s["tpot_prediction_factor"] for s in specs] == [None, 1.058] * 3
    assert result["setup"]["factor_applied"] == [1.058]
    met = result["over_seeds"]["rows"]["a"]["met_slo_fraction"]
    without = [1 / 3, 1 / 3, 1 / 2]
    with_ = [1.0, 2 / 3, 1.0]
    assert met["without"]["mean"] == pytest.approx(np.mean(without)) and met["with"]["values"] == pytest.approx(with_)
    change = np.subtract(with_, without)
    half = stats.t.ppf(0.975, 2) * change.std(ddof=1) / np.sqrt(3)
    assert met["change"]["ci95"] == pytest.approx([change.mean() - half, change.mean() + half])
    assert result["over_seeds"]["goals_met"]["p99_tpot_within_slo"] == 2  # seed 1's with-run has a 60 ms request
    assert json.loads((tmp_path / "out" / "admission.json").read_text())["over_seeds"] == json.loads(json.dumps(result["over_seeds"]))
    text = experiment.admission_markdown_summary(result)
    assert "3 seeds (0, 1, 2), prediction factor 1.058 (held-out)" in text and "| a |" in text and "2 of 3 seeds" in text
