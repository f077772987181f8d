"""The fleet experiment's analysis on hand-built replica traces: fleet-wide attributed time, the backlog rule,
fairness among backlogged tenants, the pool-counter check and the comparison with FCFS."""

from __future__ import annotations

import json

import pytest

from llmvisor import shipped
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.fleet_experiment import analyse_fleet_run, compare, fleet_tenants, pool_check
from llmvisor.fairness.policy import jain_index, max_min_ratio

T0 = 1_700_000_000.0
STEP_S = 0.1
LATENCY_S = 0.05
END_S = 10.0


@pytest.fixture(scope="module")
def model():
    return StepLatencyModel.from_json(shipped.latency_model_path())


def write_trace(path, steps: list[list[tuple[str, str]]], *, run_id: str, t0: float = T0) -> None:
    """One decode step every STEP_S from t0, each with the given (request_id, tenant) slices, context 100."""
    with open(path, "w", encoding="utf-8") as handle:
        for k, slices in enumerate(steps):
            for request_id, tenant in slices:
                row = {
                    "run_id": run_id, "step_id": k, "step_latency_s": LATENCY_S, "request_id": request_id, "tenant": tenant,
                    "num_new_tokens": 1, "num_context_tokens": 100, "phase": "decode", "timestamp_s": t0 + k * STEP_S,
                }  # fmt: skip
                handle.write(json.dumps(row) + "\n")


def client_requests(tenant: str, outstanding: int) -> list[dict]:
    """``outstanding`` requests sent at 0 and answered only after the run: outstanding throughout."""
    return [
        {"request_id": f"{tenant}-{k}", "tenant": tenant, "arrival_s": 0.0, "submitted_s": 0.0, "finish_s": None, "output_tokens": 0, "status": "unfinished"}
        for k in range(outstanding)
    ]


def finished(tenant: str, n: int, at_s: float, tokens: int = 8) -> list[dict]:
    return [
        {"request_id": f"{tenant}-done-{k}", "tenant": tenant, "arrival_s": 0.0, "submitted_s": 0.0, "finish_s": at_s, "output_tokens": tokens, "status": 200}
        for k in range(n)
    ]


def fleet_result(tmp_path, *, shared=None) -> dict:
    n_steps = int(END_S / STEP_S)
    # replica 0: heavy alone; replica 1: light-1 and light-2 in every step, plus heavy in the first half
    write_trace(tmp_path / "r0.jsonl", [[("h-0", "heavy")] for _ in range(n_steps)], run_id="r0")
    write_trace(
        tmp_path / "r1.jsonl",
        [[("a-0", "light-1"), ("b-0", "light-2")] + ([("h-1", "heavy")] if k < n_steps // 2 else []) for k in range(n_steps)],
        run_id="r1",
    )
    write_trace(tmp_path / "before.jsonl", [[("w-0", "warmup")]], run_id="r2", t0=T0 - 5.0)
    requests = (
        client_requests("heavy", 5)
        + client_requests("light-1", 5)
        # light-2 has only the one request that runs: never waiting, so never backlogged
        + client_requests("light-2", 1)
        + finished("light-1", 3, at_s=6.0)
        + finished("heavy", 2, at_s=1.0)  # before the warm-up: not counted
        + finished("heavy", 1, at_s=7.0)
    )
    return {
        "name": "test",
        "tenants": ["heavy", "light-1", "light-2"],
        "traces": [str(tmp_path / "r0.jsonl"), str(tmp_path / "r1.jsonl"), str(tmp_path / "before.jsonl"), str(tmp_path / "absent.jsonl")],
        "t0_wall_s": T0,
        "end_s": END_S,
        "requests": requests,
        "shared_counters": shared,
    }


def test_attributed_time_is_summed_over_replicas_within_the_interval(tmp_path, model):
    result = analyse_fleet_run(fleet_result(tmp_path), model, warmup_s=2.0)
    summary = result["summary"]
    steps_after_warmup = round((END_S - 2.0) / STEP_S)
    r0, r1, r2, r3 = summary["attributed_s_per_replica"]
    assert r0["heavy"] == pytest.approx(steps_after_warmup * LATENCY_S)
    assert r0["light-1"] == r0["light-2"] == 0.0
    # replica 1: three equal decodes share a step's time equally, two equal decodes half each
    heavy_steps_on_r1 = round((END_S / 2 - 2.0) / STEP_S)
    assert r1["heavy"] == pytest.approx(heavy_steps_on_r1 * LATENCY_S / 3)
    assert r1["light-1"] == pytest.approx(heavy_steps_on_r1 * LATENCY_S / 3 + (steps_after_warmup - heavy_steps_on_r1) * LATENCY_S / 2)
    assert r2 == r3 == {"heavy": 0.0, "light-1": 0.0, "light-2": 0.0}  # steps only before t0; no trace
    assert summary["attributed_s"]["heavy"] == pytest.approx(r0["heavy"] + r1["heavy"])
    assert sum(summary["attributed_fraction"].values()) == pytest.approx(1.0)
    assert summary["replica_busy_fraction"][0] == pytest.approx(LATENCY_S / STEP_S)
    assert summary["requests_per_replica"][1] == {"heavy": 1, "light-1": 1, "light-2": 1}


def test_fairness_is_taken_among_tenants_backlogged_throughout(tmp_path, model):
    summary = analyse_fleet_run(fleet_result(tmp_path), model, warmup_s=2.0)["summary"]
    assert summary["backlogged_throughout"] == ["heavy", "light-1"]
    values = [summary["attributed_s"]["heavy"], summary["attributed_s"]["light-1"]]
    assert summary["engine_time_max_min"] == pytest.approx(max_min_ratio(values))
    assert summary["jain"] == pytest.approx(jain_index(values))
    assert summary["requests_finished"] == {"heavy": 1, "light-1": 3, "light-2": 0}
    assert summary["completions_per_s"]["light-1"] == pytest.approx(3 / 8.0)
    assert summary["completions_max_min"] == pytest.approx(3.0)
    assert summary["output_tokens_per_s"] == pytest.approx(4 * 8 / 8.0)
    steps = round((END_S - 2.0) / STEP_S)  # every slice is a decode: one token each
    assert summary["decode_tokens"] == {"heavy": steps + round((END_S / 2 - 2.0) / STEP_S), "light-1": steps, "light-2": steps}
    assert summary["decode_tokens_per_s"] == pytest.approx(sum(summary["decode_tokens"].values()) / 8.0)


def test_pool_check_compares_redis_counters_with_charges_from_every_step_since_t0(tmp_path, model):
    shared = {"counters": {"heavy": 100.0, "light-1": 0.5}, "replicas_applied": 2}
    check = analyse_fleet_run(fleet_result(tmp_path, shared=shared), model, warmup_s=2.0)["pool_counters"]
    assert check["replicas_applied"] == 2
    heavy = check["tenants"]["heavy"]
    n_steps = int(END_S / STEP_S)
    assert heavy["charged_s"] == pytest.approx(n_steps * LATENCY_S + (n_steps // 2) * LATENCY_S / 3)
    assert heavy["lifted_s"] == pytest.approx(100.0 - heavy["charged_s"])
    assert check["tenants"]["light-1"]["lifted_s"] < 0  # a counter below its charges: charges were lost
    assert check["tenants"]["light-2"]["redis_counter"] is None
    assert pool_check({"counters": {}, "replicas_applied": 0}, {"x": 1.0})["tenants"]["x"]["lifted_s"] is None


def test_comparison_relates_throughput_to_fcfs(tmp_path, model):
    analysed = analyse_fleet_run(fleet_result(tmp_path), model, warmup_s=2.0)
    slower = json.loads(json.dumps(analysed))
    slower["summary"]["output_tokens_per_s"] /= 2
    slower["summary"]["decode_tokens_per_s"] /= 4
    table = compare({"fcfs": analysed, "shared": slower})
    assert table["fcfs"]["throughput_vs_fcfs"] == pytest.approx(1.0)
    assert table["shared"]["throughput_vs_fcfs"] == pytest.approx(0.5)
    assert table["shared"]["decode_throughput_vs_fcfs"] == pytest.approx(0.25)
    assert compare({"local": analysed})["local"]["throughput_vs_fcfs"] is None


def test_run_ending_before_the_warmup_and_bad_tenants_are_one_line_errors(tmp_path, model):
    with pytest.raises(LlmvisorError, match="before the warm-up"):
        analyse_fleet_run(fleet_result(tmp_path), model, warmup_s=END_S + 1)
    with pytest.raises(LlmvisorError, match="--light-tenants"):
        fleet_tenants(0, heavy_rate_rps=1, light_rate_rps=1, prompt_tokens=8, output_tokens=8)
    with pytest.raises(LlmvisorError, match="--heavy-rate-rps"):
        fleet_tenants(2, heavy_rate_rps=0, light_rate_rps=1, prompt_tokens=8, output_tokens=8)
    tenants = fleet_tenants(2, heavy_rate_rps=3, light_rate_rps=1, prompt_tokens=8, output_tokens=4)
    assert [(t["name"], t["routing"], t["rate_rps"]) for t in tenants] == [("heavy", "sticky", 3), ("light-1", "spread", 1), ("light-2", "spread", 1)]


def test_pool_check_counts_only_steps_whose_charges_had_reached_redis_when_it_was_read(tmp_path, model):
    shared = {"counters": {"heavy": 100.0}, "replicas_applied": 2, "read_s": 5.0, "flush_interval_s": 0.1}
    check = analyse_fleet_run(fleet_result(tmp_path, shared=shared), model, warmup_s=2.0)["pool_counters"]
    ended_by_4_8_s = 48  # steps k with k * 0.1 + 0.05 <= 5.0 - 2 * 0.1
    assert check["tenants"]["heavy"]["charged_s"] == pytest.approx(ended_by_4_8_s * LATENCY_S * (1 + 1 / 3))
