"""`llmvisor experiment calibration` for real, briefly: two served sessions of vLLM's OpenAI server (the suite's
engine model, dummy weights, the recorder pushing to an accounting service), a few seconds of traffic each, the
canary before each phase and after the last, a live calibration scored on the held-out session. Four phases, up
to 6 clients, so the calibration session's decode steps span the 4 batch sizes the live coverage rule asks for
(with up to 4 clients a short run sometimes showed only 3). 1 GiB of KV cache per engine (--kv-cache-gib; the
sessions hold at most 6 requests of 264 tokens, and nothing checked here depends on the pool's size)."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

from _processes import START_TIMEOUT_S, run_process  # noqa: E402
from _tiny_llama import write_suite_engine  # noqa: E402
from llmvisor.core.model import StepLatencyModel  # noqa: E402
from llmvisor.core.trace import read_trace  # noqa: E402
from llmvisor.profile.calibration_experiment import canary_mask  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.measures]  # two served sessions and a calibration


def test_two_served_sessions_calibrate_and_score_on_the_held_out_one(tmp_path):
    out = tmp_path / "experiment"
    done = run_process(
        [sys.executable, "-m", "llmvisor.cli", "experiment", "calibration", "-o", str(out), "--phases", "1,2,4,6", "--phase-s", "4",
         "--canary", "64x4", "--max-prompt-tokens", "256", "--max-output-tokens", "8", "--no-profile", "--json",
         "--engine-model", str(write_suite_engine(tmp_path / "suite-engine")), "--kv-cache-gib", "1"],
        timeout_s=2 * START_TIMEOUT_S + 900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["settings"]["kv_cache_gib"] == 1
    traces = {name: read_trace(out / f"{name}.jsonl") for name in ("calibration", "held-out")}
    for name, trace in traces.items():
        summary = result["sessions"][name]
        assert summary["n_failed_requests"] == 0 and summary["n_requests"] > 3
        assert summary["n_steps"] == trace.n_steps
        assert summary["n_canary_steps"] == int(canary_mask(trace).sum()) == 5 * 4  # before each of 4 phases and after the last: 5 canary runs of a prefill and 3 decodes
        assert len(summary["engine_fingerprints"]) == 1
    assert result["sessions"]["calibration"]["run_id"] != result["sessions"]["held-out"]["run_id"]
    assert result["ledger_steps"] == sum(trace.n_steps for trace in traces.values())  # every step of both sessions stored (pending: the service has no model of the served class)
    assert result["sessions"]["calibration"]["workload"] == "azure-2023-conv.csv"
    assert result["sessions"]["held-out"]["workload"] == "azure-2023-code.csv"
    floor = result["noise_floor"]
    assert floor["n_groups"] == 4 and floor["n_canary_steps"] == [20, 20] and 0 <= floor["p50"] < 1
    live = StepLatencyModel.from_json(out / "live.json")
    assert live.engine_fingerprint_["id"] == traces["held-out"].engine_fingerprint_ids()[0]  # same settings, one class
    assert set(result["residuals"]) == {"shipped", "live"} and "profile" not in result["calibrations"]
    held_out = traces["held-out"]
    held_out_traffic = int((~canary_mask(held_out) & ~held_out.is_warmup_per_step).sum())
    assert result["residuals"]["live"]["all"]["n_steps"] == held_out_traffic
    assert result["goal"]["limit"] == pytest.approx(1.5 * floor["p50"])
