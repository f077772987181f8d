"""`llmvisor calibrate` without an engine: the coverage rule, where the served fingerprint is read, the profile
command it runs, and the drift canaries' rule."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from llmvisor.cli.calibrate import profile_command, profile_environment
from llmvisor.core.fingerprint import fingerprint_sidecar
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import trace_from_rows, write_trace
from llmvisor.errors import LlmvisorError
from llmvisor.profile.calibration import live_coverage, read_fingerprint, residual_quantiles
from llmvisor.profile.drift import CANARY_INDEX_BASE, canary_drift, canary_episode, is_canary_episode, with_canaries
from llmvisor.profile.plans import Envelope, sweep_episodes
from test_fingerprint import SERVED, fingerprinted_trace

ROOT = Path(__file__).resolve().parents[1]


def llmvisor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmvisor.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_coverage_rule_names_what_is_missing():
    assert live_coverage(fingerprinted_trace(SERVED, 600))["missing"] == []
    small = live_coverage(synthetic_trace(120, prefill_fraction=0.05, max_batch_size=2, seed=3))
    text = "; ".join(small["missing"])
    assert "steps (need 200)" in text and "with prefill (need 20)" in text and "decode batch sizes (need 4)" in text
    mixed = fingerprinted_trace(SERVED, 600)
    ids = np.asarray(mixed.extra["engine_fingerprint"])
    ids[:10] = "another"
    assert "2 engine fingerprints" in "; ".join(live_coverage(mixed)["missing"])


def test_calibrate_from_a_live_trace_writes_a_model_of_that_engine(tmp_path):
    trace_path = tmp_path / "live.parquet"
    write_trace(fingerprinted_trace(SERVED, 600), trace_path)
    done = llmvisor("calibrate", "--from-trace", str(trace_path), "-o", str(tmp_path / "m.json"),
                    "--evaluate-on", str(trace_path), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["mode"] == "live" and result["model_fingerprint"]["id"] == SERVED.id
    assert StepLatencyModel.from_json(tmp_path / "m.json").engine_fingerprint_["id"] == SERVED.id
    after = result["evaluation"]["models"]["calibrated"]
    assert after["abs_relative_residual_p90"] < 0.05 < result["evaluation"]["models"]["baseline"]["abs_relative_residual_p90"]


def test_calibrate_refuses_a_live_trace_that_covers_too_little(tmp_path):
    trace_path = tmp_path / "live.parquet"
    write_trace(synthetic_trace(50, seed=2), trace_path)
    done = llmvisor("calibrate", "--from-trace", str(trace_path), "-o", str(tmp_path / "m.json"))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "50 steps (need 200)" in done.stderr and "--fingerprint" in done.stderr
    assert not (tmp_path / "m.json").exists()


def test_the_served_fingerprint_is_read_from_a_record_a_sidecar_or_parquet_metadata(tmp_path):
    record = tmp_path / "served.jsonl.engine.json"
    record.write_text(json.dumps(SERVED.to_dict()))
    assert record == fingerprint_sidecar(tmp_path / "served.jsonl")
    (tmp_path / "served.jsonl").write_text("")
    assert read_fingerprint(record) == read_fingerprint(tmp_path / "served.jsonl") == SERVED
    write_trace(fingerprinted_trace(SERVED, 50), tmp_path / "t.parquet")
    assert read_fingerprint(tmp_path / "t.parquet").id == SERVED.id
    (tmp_path / "other.jsonl").write_text("")
    with pytest.raises(LlmvisorError, match="other.jsonl.engine.json"):
        read_fingerprint(tmp_path / "other.jsonl")


def test_the_profile_runs_with_the_served_settings_on_its_cores(tmp_path):
    options = {"engine_model": None, "points": 8, "max_decode_steps": 12, "canary_every": 4, "kv_cache_gib": 2}
    served = replace(SERVED, core_ids=(2, 3), threads=2)
    command = profile_command(served, tmp_path / "p.parquet", **options)
    flags = dict(zip(command, command[1:]))
    assert flags["--max-num-seqs"] == "128" and flags["--max-num-batched-tokens"] == "2048" and flags["--max-model-len"] == "4096"
    assert flags["--executor"] == "mp" and "--cores" not in flags and "--threads" not in flags
    assert profile_environment(served, {"A": "1"}) == {"A": "1", "VLLM_CPU_OMP_THREADS_BIND": "2,3"}
    assert "--prefix-caching" in command and "--no-enforce-eager" in command
    in_process = replace(served, executor_backend="uni", enable_prefix_caching=False)
    command = profile_command(in_process, tmp_path / "p.parquet", **options)
    flags = dict(zip(command, command[1:]))
    assert flags["--threads"] == "2" and flags["--cores"] == "2,3" and "--executor" not in flags
    assert "--no-prefix-caching" in command
    assert profile_environment(in_process, {"A": "1"}) == {"A": "1"}


def test_canaries_bracket_the_sweep():
    envelope = Envelope(4096, 2048, 32)
    episodes = sweep_episodes(envelope, 10, seed=0)
    planned = with_canaries(episodes, envelope, 4)
    assert [is_canary_episode(e) for e in planned].count(True) == 4  # before 0, 4, 8 and after the last
    assert is_canary_episode(planned[0]) and is_canary_episode(planned[-1])
    first, second = canary_episode(envelope, 0), canary_episode(envelope, 1)
    assert (first.prompt_lens, first.seed, first.token_budget) == (second.prompt_lens, second.seed, second.token_budget)
    assert with_canaries(episodes, envelope, 0) == episodes


def canary_trace(slowdown: dict[int, float], n_canaries: int = 5, steps_per_canary: int = 6, sweep_steps: int = 10):
    """Canary runs (request ids as the profile names them) between sweep episodes; canary k slowed by slowdown[k]."""
    rng = np.random.default_rng(0)
    rows, step = [], 0
    base = 0.01 * (1 + np.arange(steps_per_canary))
    for k in range(n_canaries):
        for position in range(steps_per_canary):
            latency = base[position] * (1 + slowdown.get(k, 0.0)) * (1 + 0.01 * rng.standard_normal())
            rows.append({"run_id": "p", "step_id": step, "step_latency_s": latency, "request_id": f"sweep-e{CANARY_INDEX_BASE + k:04d}-r0-000",
                         "tenant": "sweep", "num_new_tokens": 1, "num_context_tokens": 64 + position, "phase": "decode"})
            step += 1
        if k < n_canaries - 1:
            for _ in range(sweep_steps):
                rows.append({"run_id": "p", "step_id": step, "step_latency_s": 0.02, "request_id": f"sweep-e{k:04d}-r0-000",
                             "tenant": "sweep", "num_new_tokens": 1, "num_context_tokens": 10, "phase": "decode"})
                step += 1
    return trace_from_rows(rows)


def test_a_drifted_canary_flags_the_steps_around_it():
    trace = canary_trace({2: 0.3})
    drifted, summary = canary_drift(trace, 0.1)
    assert [c["drifted"] for c in summary["canaries"]] == [False, False, True, False, False]
    assert summary["canaries"][2]["drift"] == pytest.approx(0.3, abs=0.03)
    # the sweep episodes on either side of canary 2 (10 steps each) and its own 6 steps
    assert summary["n_drifted_steps"] == drifted.sum() == 26
    assert not drifted[:22].any() and drifted[22:48].all() and not drifted[48:].any()
    quiet, quiet_summary = canary_drift(canary_trace({}), 0.1)
    assert not quiet.any() and quiet_summary["max_abs_drift"] < 0.05


def test_residual_quantiles_are_of_measured_minus_predicted_over_measured():
    trace = synthetic_trace(300, seed=4)
    model = StepLatencyModel().fit(trace)
    figures = residual_quantiles(model, trace)
    keep = ~trace.is_warmup_per_step
    relative = 1 - model.predict(trace)[keep] / trace.step_latency_s_per_step[keep]
    assert figures["relative_residual_p50"] == pytest.approx(float(np.median(relative)))
    assert figures["abs_relative_residual_p90"] == pytest.approx(float(np.quantile(np.abs(relative), 0.9)))
