"""The calibration experiment's analysis, without an engine: which steps are the canary's, the noise floor over
them, the held-out scoring (canary steps left out), the goal, and the CLI's option parsing."""

from __future__ import annotations

import numpy as np
import pytest

from llmvisor.cli.experiment import parse_canary, parse_int_list
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import trace_from_rows
from llmvisor.errors import LlmvisorError
from llmvisor.profile.calibration_experiment import CANARY_TENANT, canary_floor, canary_mask, markdown_summary, score


def session(latency_scale: list[float], run_id: str, *, traffic_latency_s: float = 0.02) -> list[dict]:
    """A served session: before each canary run a traffic step (two tenants); each canary run is a prefill of
    64 tokens and three decode steps of one request, its step times scaled by ``latency_scale[k]``."""
    rows: list[dict] = []
    step = 0
    base = [0.030, 0.010, 0.0102, 0.0104]
    for k, scale in enumerate(latency_scale):
        for tenant in ("team-0", "team-1"):
            rows.append({"run_id": run_id, "step_id": step, "step_latency_s": traffic_latency_s, "request_id": f"t{k}-{tenant}",
                         "tenant": tenant, "num_new_tokens": 1, "num_context_tokens": 100 + k, "phase": "decode"})
        step += 1
        for position, latency_s in enumerate(base):
            rows.append({"run_id": run_id, "step_id": step, "step_latency_s": latency_s * scale, "request_id": f"c{k}",
                         "tenant": CANARY_TENANT, "num_new_tokens": 64 if position == 0 else 1,
                         "num_context_tokens": 0 if position == 0 else 63 + position, "phase": "prefill" if position == 0 else "decode"})
            step += 1
    return rows


def test_canary_steps_are_those_with_only_canary_slices():
    trace = trace_from_rows(session([1.0, 1.0], "a"))
    mask = canary_mask(trace)
    assert mask.tolist() == [False, True, True, True, True, False, True, True, True, True]
    mixed = session([1.0], "b")
    mixed.append({**mixed[-1], "request_id": "other", "tenant": "team-0"})  # a traffic request joins the canary's last step
    assert canary_mask(trace_from_rows(mixed)).tolist() == [False, True, True, True, False]


def test_noise_floor_is_the_spread_of_identical_canary_steps_across_sessions():
    steady = canary_floor([trace_from_rows(session([1.0, 1.0, 1.0], "a")), trace_from_rows(session([1.0, 1.0, 1.0], "b"))])
    assert steady["p50"] == 0 and steady["n_groups"] == 4 and steady["n_canary_steps"] == [12, 12]
    # one session 10% slower than the other: every step is 0.05 from its composition's mean (1.05) over 4 steps,
    # scaled by sqrt(4 / 3) to one measurement's error (the one floor, `replicate_noise_floor`)
    shifted = canary_floor([trace_from_rows(session([1.0, 1.0], "a")), trace_from_rows(session([1.1, 1.1], "b"))])
    assert shifted["p50"] == pytest.approx(0.05 * (4 / 3) ** 0.5 / 1.05, rel=1e-9)
    with pytest.raises(LlmvisorError, match="no canary composition was measured twice"):
        canary_floor([trace_from_rows(session([1.0], "a"))])


def test_the_held_out_score_leaves_the_canary_out():
    held_out = trace_from_rows(session([1.0, 1.0, 1.0], "b", traffic_latency_s=0.04))
    model = StepLatencyModel().fit(synthetic_trace(400, seed=1))
    figures = score(model, held_out)
    assert figures["all"]["n_steps"] == figures["decode_only"]["n_steps"] == 3  # the traffic steps only
    assert figures["with_prefill"] is None  # the only prefill steps were the canary's
    predicted = model.predict(held_out)[~canary_mask(held_out)]
    expected = np.median(np.abs(0.04 - predicted) / 0.04)
    assert figures["all"]["abs_relative_residual_p50"] == pytest.approx(expected)


def test_the_summary_states_the_goal_from_the_figures():
    residual = {"n_steps": 10, "relative_residual_p10": -0.05, "relative_residual_p50": 0.01, "relative_residual_p90": 0.06,
                "abs_relative_residual_p50": 0.04, "abs_relative_residual_p90": 0.09}
    result = {
        "settings": {"phases": [1, 2], "phase_s": 15.0},
        "sessions": {"calibration": {"workload": "a.csv", "n_steps": 2000}, "held-out": {"workload": "b.csv", "n_steps": 1900}},
        "ledger_steps": 3900,
        "noise_floor": {"p50": 0.03, "p90": 0.1, "n_groups": 32, "n_steps": 500},
        "goal": {"limit": 0.045, "met": {"live": True, "shipped": False}},
        "residuals": {"live": {"all": residual, "decode_only": residual, "with_prefill": residual},
                      "shipped": {"all": {**residual, "abs_relative_residual_p50": 0.4}, "decode_only": residual, "with_prefill": residual}},
        "calibrations": {},
    }
    text = markdown_summary(result)
    assert "p50 3.0%, p90 10.0%" in text and "(4.5%)" in text and "every step of both reached the ledger (3,900)" in text
    assert "| 4.0% / 9.0% | -5.0% / +1.0% / +6.0% | 4.0% | 4.0% | met |" in text
    assert "| 40.0% / 9.0% |" in text and text.rstrip().endswith("not met |")


def test_option_lists_are_parsed_with_clear_errors():
    assert parse_int_list("1,2, 8", "--phases") == [1, 2, 8]
    assert parse_canary("384x16,1024x16") == [[384, 16], [1024, 16]]
    with pytest.raises(LlmvisorError, match="--phases: expected whole numbers"):
        parse_int_list("1,two", "--phases")
    with pytest.raises(LlmvisorError, match="--phases: expected one or more numbers >= 1"):
        parse_int_list("0", "--phases")
    with pytest.raises(LlmvisorError, match="--canary: '384' is not PROMPTxOUTPUT"):
        parse_canary("384")
    with pytest.raises(LlmvisorError, match="--canary: '64x1' is not PROMPTxOUTPUT"):
        parse_canary("64x1")


def test_an_unknown_workload_is_refused_before_any_engine_starts(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "llmvisor.cli", "experiment", "calibration", "-o", str(tmp_path / "out"),
                           "--workload", "no-such-mix", "--workload", "azure-2023-code"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--workload:" in done.stderr and "no-such-mix.csv: no such workload file (shipped: azure-2023-conv" in " ".join(done.stderr.split())
    assert not (tmp_path / "out").exists()
