"""`llmvisor calibrate` without an engine: the coverage rule, where the served fingerprint is read, the profile
command it runs, and the drift canaries' rule."""

from __future__ import annotations

import io
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from _processes import cli_process
from llmvisor.cli.calibrate import combine_profiles, profile_command, profile_environment
from llmvisor.core.fingerprint import fingerprint_sidecar
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.core.trace import trace_from_rows, write_trace
from llmvisor.errors import LlmvisorError
from llmvisor.profile.calibration import (
    STEP_KINDS,
    describe_short_fit,
    fit_usable,
    live_coverage,
    read_fingerprint,
    residual_quantiles,
    step_kinds,
)
from llmvisor.profile.drift import (
    CANARY_INDEX_BASE,
    canary_drift,
    canary_episode,
    is_canary_episode,
    mark_drifted,
    profile_level_drift,
    with_canaries,
)
from llmvisor.profile.eta import SweepClock, SweepProgress, episode_work
from llmvisor.profile.plans import Envelope, sweep_episodes
from test_fingerprint import SERVED, fingerprinted_trace

ROOT = Path(__file__).resolve().parents[1]


def llmvisor(*args: str) -> subprocess.CompletedProcess:
    return cli_process(*args, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, timeout_s=300)


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
    assert flags["--dtype"] == SERVED.dtype  # vLLM resolved it for the served engine: the profile asks for the same
    float32 = profile_command(replace(served, dtype="float32"), tmp_path / "p.parquet", **options)
    assert dict(zip(float32, float32[1:]))["--dtype"] == "float32"  # a class served in float32 is profiled in float32
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


def canary_trace(slowdown: dict[int, float], n_canaries: int = 5, steps_per_canary: int = 6, sweep_steps: int = 10,
                 run_id: str = "p", level: float = 0.0, seed: int = 0):
    """Canary runs (request ids as the profile names them) between sweep episodes; canary k slowed by slowdown[k],
    every step of the profile by ``level``."""
    rng = np.random.default_rng(seed)
    rows, step = [], 0
    base = 0.01 * (1 + np.arange(steps_per_canary))
    for k in range(n_canaries):
        for position in range(steps_per_canary):
            latency = base[position] * (1 + level) * (1 + slowdown.get(k, 0.0)) * (1 + 0.01 * rng.standard_normal())
            rows.append({"run_id": run_id, "step_id": step, "step_latency_s": latency, "request_id": f"sweep-e{CANARY_INDEX_BASE + k:04d}-r0-000",
                         "tenant": "sweep", "num_new_tokens": 1, "num_context_tokens": 64 + position, "phase": "decode"})
            step += 1
        if k < n_canaries - 1:
            for _ in range(sweep_steps):
                rows.append({"run_id": run_id, "step_id": step, "step_latency_s": 0.02 * (1 + level), "request_id": f"sweep-e{k:04d}-r0-000",
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


def test_on_a_machine_that_swings_all_the_time_only_a_canary_out_of_line_with_the_swing_drifts():
    """Canary runs up to 20% either side, in no order (the machine's speed swinging throughout): none is out of
    line with the rest, so none drifts (at a flat 10% cut four would, and most of the profile's steps with
    them); one run slowed 80% on top stands out of the swing and drifts."""
    levels = [0.05, -0.2, 0.15, 0.0, -0.1, 0.2, -0.05, 0.1, -0.15]
    swing = dict(enumerate(levels))
    drifted, summary = canary_drift(canary_trace(swing, n_canaries=9), 0.1)
    assert not drifted.any() and summary["n_drifted_canaries"] == 0
    assert summary["cut"] > 0.3 and summary["cut"] == pytest.approx(3 * summary["spread"])
    assert sum(abs(c["drift"]) > 0.1 for c in summary["canaries"]) >= 4  # what a flat cut would have dropped
    drifted, summary = canary_drift(canary_trace({**swing, 4: 0.8}, n_canaries=9), 0.1)
    assert [c["drifted"] for c in summary["canaries"]] == [k == 4 for k in range(9)]
    steady = canary_drift(canary_trace({2: 0.3}), 0.1)[1]
    assert steady["cut"] == 0.1  # a steady machine: the flat threshold holds


def test_a_profile_whose_machine_level_differs_from_the_median_profile_drifts_whole():
    """Separate engine starts: each profile's canaries only see changes within it, so the profiles' median
    canary runs are compared with each other; with two that disagree no majority says which was right."""
    quiet = [canary_trace({}, run_id=f"p{k}", seed=k) for k in range(2)]
    slow = canary_trace({1: 0.3}, run_id="slow", level=0.3, seed=7)  # slower throughout, one canary more so
    drifted, summary = profile_level_drift([quiet[0], slow, quiet[1]], 0.1)
    assert drifted == [False, True, False] == summary["drifted"]
    assert summary["levels"][1] == pytest.approx(0.3, abs=0.03) and abs(summary["levels"][0]) < 0.03
    assert profile_level_drift([quiet[0], slow], 0.1)[0] == [True, True]
    assert profile_level_drift(quiet, 0.1)[0] == [False, False]
    assert profile_level_drift(quiet[:1], 0.1)[0] == [False]

    mark_drifted(slow, canary_drift(slow, 0.1)[0])  # its own canary 1 drifted; the others see no drift within it
    own = slow.is_drifted_per_step.copy()
    assert 0 < own.sum() < slow.n_steps and "is_drifted" not in quiet[0].extra
    combined, _ = combine_profiles([quiet[0], slow, quiet[1]])
    n = [quiet[0].n_steps, slow.n_steps, quiet[1].n_steps]
    flags = combined.is_drifted_per_step
    assert flags[n[0]:n[0] + n[1]].all() and not flags[:n[0]].any() and not flags[n[0] + n[1]:].any()
    assert (slow.is_drifted_per_step == own).all()  # the profile read stays as it was
    kept, _ = combine_profiles([quiet[0], slow, canary_trace({}, run_id="p2", seed=2), canary_trace({}, run_id="p3", seed=3)])
    assert kept.is_drifted_per_step.sum() == slow.n_steps  # a profile without its own flags is still held to the level rule
    _, level = combine_profiles([quiet[0], quiet[1].select_steps(np.ones(quiet[1].n_steps, dtype=bool))])
    assert level["drifted"] == [False, False]


def test_calibrate_profiles_again_and_fits_on_the_steady_steps_of_all_profiles(tmp_path, monkeypatch):
    """The retry loop, with the profiles' traces given (the journey in docs/recorder.md runs it on vLLM): the
    first profile drifted too much to fit on, the second's steady steps with the first's are enough."""
    import llmvisor.cli.calibrate as calibrate_cli

    first = fingerprinted_trace(SERVED, 400, seed=5)
    second = fingerprinted_trace(SERVED, 400, seed=6)
    second.run_id[:] = "second"
    for trace, n_drifted in ((first, 330), (second, 250)):
        flags = np.zeros(trace.n_steps, dtype=bool)
        flags[:n_drifted] = True
        mark_drifted(trace, flags)
    profiles = iter([first, second])
    calls = []

    def profile(served, path, **options):
        calls.append(Path(path).name)
        write_trace(next(profiles), path)
        return {"n_steps": 400}

    monkeypatch.setattr(calibrate_cli, "run_profile", profile)
    alone = StepLatencyModel().fit(first)
    assert fit_usable(alone, first)["short"]  # the first profile alone is refused
    fingerprint = tmp_path / "served.engine.json"
    fingerprint.write_text(json.dumps(SERVED.to_dict()))
    calibrate_cli.calibrate(output=tmp_path / "m.json", fingerprint=fingerprint, from_trace=None, engine_model=None,
                            points=12, max_decode_steps=16, max_episode_tokens=16384, canary_every=2, attempts=3,
                            kv_cache_gib=2, trace_output=None, evaluate_on=None, baseline_model=None,
                            allow_few_steps=False, json_output=False)
    assert calls == ["m.profile.parquet", "m.profile.attempt-2.parquet"]  # stopped once enough steps were kept
    model = StepLatencyModel.from_json(tmp_path / "m.json")
    assert model.fit_info_["n_drifted_dropped"] == 580 and model.fit_info_["n_steps_total"] == 800

    calls.clear()
    profiles = iter([first])
    with pytest.raises(LlmvisorError, match="the fit kept"):
        calibrate_cli.calibrate(output=tmp_path / "n.json", fingerprint=fingerprint, from_trace=None, engine_model=None,
                                points=12, max_decode_steps=16, max_episode_tokens=16384, canary_every=2, attempts=1,
                                kv_cache_gib=2, trace_output=None, evaluate_on=None, baseline_model=None,
                                allow_few_steps=False, json_output=False)
    assert calls == ["n.profile.parquet"] and not (tmp_path / "n.json").exists()


def test_residual_quantiles_are_of_measured_minus_predicted_over_measured():
    trace = synthetic_trace(300, seed=4)
    model = StepLatencyModel().fit(trace)
    figures = residual_quantiles(model, trace)
    keep = ~trace.is_warmup_per_step
    relative = 1 - model.predict(trace)[keep] / trace.step_latency_s_per_step[keep]
    assert figures["relative_residual_p50"] == pytest.approx(float(np.median(relative)))
    assert figures["abs_relative_residual_p90"] == pytest.approx(float(np.quantile(np.abs(relative), 0.9)))


def mostly_drifted(n_steps: int, keep_mixed: int, seed: int = 4):
    """A fingerprinted synthetic trace whose mixed steps, all but ``keep_mixed``, a profile flagged drifted."""
    trace = synthetic_trace(n_steps, seed=seed, max_batch_size=6)
    trace.extra["engine_fingerprint"] = np.full(trace.n_slices, SERVED.id, dtype=object)
    kinds = step_kinds(trace)
    drifted = kinds == STEP_KINDS.index("mixed")
    drifted[np.flatnonzero(drifted)[:keep_mixed]] = False
    trace.extra["is_drifted"] = np.repeat(drifted, trace.batch_size_per_step)
    return trace, drifted


def test_the_fit_rule_counts_what_the_drift_and_outlier_rules_left():
    """The issue's run: 127 steps, 109 of them drifted, a fit on what is left."""
    trace = fingerprinted_trace(SERVED, 127, seed=5)
    drifted = np.zeros(trace.n_steps, dtype=bool)
    drifted[:109] = True
    trace.extra["is_drifted"] = np.repeat(drifted, trace.batch_size_per_step)
    model = StepLatencyModel().fit(trace)
    usable = fit_usable(model, trace)
    assert usable["n_drifted_dropped"] == 109 and usable["n_steps_used"] <= 18
    assert f"{usable['n_steps_used']} steps (need 100)" in usable["short"]
    assert "decode-only (need 50)" in "; ".join(usable["short"])
    line = describe_short_fit(usable)
    assert line.startswith(f"the fit kept {usable['n_steps_used']} of 127 steps (0 warm-up, 109 drifted,") and "\n" not in line
    assert fit_usable(StepLatencyModel().fit(fingerprinted_trace(SERVED, 600)), fingerprinted_trace(SERVED, 600))["short"] == []


def test_calibrate_refuses_a_fit_whose_covered_step_kind_was_dropped_and_allow_few_steps_overrides(tmp_path):
    trace, drifted = mostly_drifted(600, keep_mixed=4)
    covered = int(drifted.sum()) + 4
    assert live_coverage(trace)["missing"] == []  # enough steps before the fit: only the fit rule catches it
    trace_path = tmp_path / "live.parquet"
    write_trace(trace, trace_path)
    done = llmvisor("calibrate", "--from-trace", str(trace_path), "-o", str(tmp_path / "m.json"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert f"4 of {covered} mixed steps (need 10)" in done.stderr and f"{int(drifted.sum())} drifted" in done.stderr
    assert "--allow-few-steps" in done.stderr and not (tmp_path / "m.json").exists()
    allowed = llmvisor("calibrate", "--from-trace", str(trace_path), "-o", str(tmp_path / "m.json"), "--allow-few-steps", "--json")
    assert allowed.returncode == 0, allowed.stderr
    assert "warning: fitted on too few steps" in allowed.stderr and f"4 of {covered} mixed steps" in allowed.stderr
    assert json.loads(allowed.stdout)["usable"]["kinds"]["mixed"] == {"covered": covered, "used": 4}
    assert (tmp_path / "m.json").exists()


def test_the_sweep_estimate_comes_from_the_measured_episodes():
    """Episodes whose time is a fixed cost plus a cost per prompt token and per step: after three are measured
    the estimate of the rest is exact; before, it scales the time so far by the work left."""
    episodes = with_canaries(sweep_episodes(Envelope(4096, 2048, 32), 12, max_decode_steps=16, max_episode_tokens=16384),
                             Envelope(4096, 2048, 32), 2)
    true_s = [0.4 + 2e-3 * tokens + 0.05 * steps for tokens, steps in map(episode_work, episodes)]
    clock = SweepClock.for_episodes(episodes)
    assert clock.remaining_s() is None and clock.n_total == len(episodes)
    clock.record(true_s[0])
    assert clock.remaining_s() > 0 and "scaled from the 1 episode measured" in clock.line()
    for seconds in true_s[1:4]:
        clock.record(seconds)
    assert clock.remaining_s() == pytest.approx(sum(true_s[4:]), rel=1e-6)
    assert f"episode 4 of {len(episodes)} done" in clock.line() and "fitted on the 4 episodes measured" in clock.line()
    slower = SweepClock.for_episodes(episodes)  # a machine 70x slower: the estimate follows it, no fixed figure
    for seconds in true_s[:4]:
        slower.record(70 * seconds)
    assert slower.remaining_s() == pytest.approx(70 * sum(true_s[4:]), rel=1e-6)


def test_the_sweep_prints_its_progress_and_estimate_as_log_lines():
    from rich.console import Console

    output = io.StringIO()
    console = Console(file=output, width=300)
    assert not console.is_terminal
    episodes = sweep_episodes(Envelope(4096, 2048, 32), 8, max_decode_steps=16)
    progress = SweepProgress(SweepClock.for_episodes(episodes), console.print, every_s=30.0)
    for seconds in (12.0, 10.0, 10.0, 11.0, 20.0, 5.0, 5.0, 5.0):
        progress.episode_done(seconds)
    lines = output.getvalue().splitlines()
    assert lines[0].startswith("sweep: episode 1 of 8 done after 12 s; about ") and "left (about" in lines[0]
    assert [line.split(" done")[0] for line in lines] == ["sweep: episode 1 of 8", "sweep: episode 4 of 8",
                                                          "sweep: episode 7 of 8", "sweep: episode 8 of 8"]
    assert lines[-1] == "sweep: episode 8 of 8 done after 1 min 18 s"


def test_the_documented_profile_duration_is_the_measured_one():
    result = json.loads((ROOT / "docs" / "results" / "calibration.json").read_text(encoding="utf-8"))
    wall_s = result["calibrations"]["profile"]["profile"]["wall_time_s"]
    doc = (ROOT / "docs" / "recorder.md").read_text(encoding="utf-8")
    assert result["settings"]["profile_points"] == 12
    assert f"The `--points 12` profile of `llmvisor experiment calibration` below ran {wall_s:.0f} s" in " ".join(doc.split())
    assert "4 minutes" not in doc
