"""The calibration experiment: does `llmvisor calibrate` bring a served run within the served engine's noise floor?

Two served sessions of vLLM's OpenAI server as the operator journey runs it (`llmvisor.engines.vllm.served`),
each pushing its steps to an accounting service: a calibration session on one workload's request lengths and
a held-out session on another's, a new engine start each. `llmvisor calibrate` fits a model on the calibration
session's live steps (``--from-trace``) and, optionally, on a profile of the served engine's settings
(``--fingerprint``); each model, and the shipped one, is then scored on the held-out session only (its traffic
steps; the canary's are the floor's), by relative residual (measured − predicted) / measured.

The noise floor is the canary's: steps of identical composition, from both sessions, grouped by composition:
the one floor (`llmvisor.profile.stats.noise_floor`, `llmvisor.core.stats.replicate_noise_floor`, as ``profile
--repeat``), one measurement's deviation from its group's mean scaled by √(k/(k−1)), with its interval. It is
re-measuring an identical served step minutes or a restart apart, as a model fitted on one session and scored
on another must. The goal (issue: served residual p50 within 1.5× of the noise floor) is checked on p50.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from llmvisor import shipped
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import StepTrace, concat_traces, read_trace
from llmvisor.engine_process import run_engine_module
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.profile.calibration import residual_quantiles
from llmvisor.profile.stats import floor_text, noise_floor
from llmvisor.service.process import ServerProcess

CANARY_TENANT = "canary"
GOAL_RATIO = 1.5
SESSIONS = ("calibration", "held-out")
MODEL_LABELS = {
    "shipped": "shipped model (an in-process sweep, no fingerprint)",
    "live": "calibrated on the calibration session's live steps (`--from-trace`)",
    "profile": "calibrated on a profile of the served settings (`--fingerprint`)",
}


def canary_mask(trace: StepTrace) -> np.ndarray:
    """Steps whose every slice is the canary's."""
    is_canary = trace.tenant == CANARY_TENANT
    per_step = np.add.reduceat(is_canary.astype(np.int64), trace.step_starts) if trace.n_slices else np.zeros(0, dtype=np.int64)
    return per_step == trace.batch_size_per_step


def canary_floor(traces: list[StepTrace]) -> dict:
    """`noise_floor` over the canary steps of all sessions, and how many canary runs each session held."""
    canary = [trace.select_steps(canary_mask(trace)) for trace in traces]
    floor = noise_floor(concat_traces(canary))
    if floor is None:
        raise LlmvisorError("no canary composition was measured twice: no noise floor")
    return {**floor, "n_canary_steps": [int(c.n_steps) for c in canary]}


def score(model: StepLatencyModel, held_out: StepTrace) -> dict:
    """Residual quantiles on the held-out traffic steps: all, decode-only, with a prefill slice (None: no such steps)."""
    traffic = held_out.select_steps(~canary_mask(held_out))
    figures = {"all": residual_quantiles(model, traffic)}
    for kind, mask in (("decode_only", ~traffic.is_prefill_per_step), ("with_prefill", traffic.is_prefill_per_step)):
        kept = mask & ~traffic.is_warmup_per_step
        figures[kind] = residual_quantiles(model, traffic.select_steps(mask)) if kept.any() else None
    return figures


def run_session(spec: dict, log_path: Path) -> dict:
    """One served session in a fresh process (`llmvisor.engines.vllm.served`); its result dict."""
    out_dir = Path(spec["out_dir"])
    return run_engine_module("llmvisor.engines.vllm.served", spec, spec_path=out_dir / f"{spec['name']}.spec.json",
                             result_path=out_dir / f"{spec['name']}.result.json", log_path=log_path, what=f"served session {spec['name']}")


def run_calibrate(arguments: list[str], log_path: Path) -> dict:
    """``llmvisor calibrate ... --json``, as an operator runs it; its JSON result."""
    with open(log_path, "w", encoding="utf-8") as log:
        done = subprocess.run([sys.executable, "-m", "llmvisor.cli", "calibrate", *arguments, "--json"],
                              stdout=subprocess.PIPE, stderr=log, text=True)
    if done.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        raise LlmvisorError(f"llmvisor calibrate {' '.join(arguments)} failed (exit {done.returncode}); see {log_path}:\n" + "\n".join(tail))
    return json.loads(done.stdout)


def ledger_steps(db_url: str) -> int:
    """Steps the ledger holds, billed or pending (the served engine's class has no model in this service)."""
    ledger = Ledger(db_url)
    try:
        totals = ledger.totals()
        return int(totals.num_steps + totals.pending_steps)
    finally:
        ledger.close()


def run_calibration_experiment(
    out_dir: Path,
    *,
    engine_dir: Path,
    workloads: tuple[Path, Path],
    phases: list[int],
    phase_s: float,
    canary: list[list[int]],
    max_prompt_tokens: int,
    max_output_tokens: int,
    seed: int,
    kv_cache_gib: int,
    profile: bool,
    profile_points: int,
    profile_max_decode_steps: int,
    analyse_only: bool = False,
) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    traces = [out_dir / f"{name}.jsonl" for name in SESSIONS]
    sessions_path = out_dir / "sessions.json"
    if analyse_only:
        if not sessions_path.exists():
            raise LlmvisorError(f"{sessions_path}: no sessions to analyse (run without --analyse-only first)")
        sessions = json.loads(sessions_path.read_text(encoding="utf-8"))
    else:
        db_url = f"sqlite:///{out_dir / 'ledger.db'}"
        for stale in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):  # an earlier run's ledger, with its write-ahead log
            (out_dir / stale).unlink(missing_ok=True)
        ledger = Ledger(db_url)
        try:
            key = ledger.create_key(is_admin=True)
        finally:
            ledger.close()
        sessions = {}
        with ServerProcess(shipped.latency_model_path(), db_url, log_path=out_dir / "service.log") as service:
            for k, (name, workload) in enumerate(zip(SESSIONS, workloads)):
                spec = {
                    "name": name, "out_dir": str(out_dir), "model_dir": str(engine_dir), "service_url": service.url,
                    "service_key": key, "kv_cache_gib": kv_cache_gib, "phases": phases, "phase_s": phase_s, "canary": canary,
                    "seed": seed + k,
                    "workload": {"path": str(workload), "max_prompt_tokens": max_prompt_tokens, "max_output_tokens": max_output_tokens},
                }  # fmt: skip
                sessions[name] = run_session(spec, out_dir / f"{name}.log")
        sessions["ledger_steps"] = ledger_steps(db_url)
        sessions_path.write_text(json.dumps(sessions), encoding="utf-8")
    calibration_trace, held_out_trace = (read_trace(path) for path in traces)
    calibrations = {"live": run_calibrate(["--from-trace", str(traces[0]), "-o", str(out_dir / "live.json")], out_dir / "calibrate-live.log")}
    profiled, saved_profile = out_dir / "profile.json", out_dir / "profile.calibration.json"
    if profile:
        if analyse_only and profiled.exists() and saved_profile.exists():
            calibrations["profile"] = json.loads(saved_profile.read_text(encoding="utf-8"))
        else:
            calibrations["profile"] = run_calibrate(
                ["--fingerprint", str(traces[0]), "-o", str(profiled), "--points", str(profile_points),
                 "--max-decode-steps", str(profile_max_decode_steps)],
                out_dir / "calibrate-profile.log",
            )  # fmt: skip
            saved_profile.write_text(json.dumps(calibrations["profile"]), encoding="utf-8")
    models = {"shipped": StepLatencyModel.from_json(shipped.latency_model_path()), "live": StepLatencyModel.from_json(out_dir / "live.json")}
    if "profile" in calibrations:
        models["profile"] = StepLatencyModel.from_json(profiled)
    floor = canary_floor([calibration_trace, held_out_trace])
    residuals = {name: score(model, held_out_trace) for name, model in models.items()}
    result = {
        "settings": {
            "engine_model": shipped.portable_path(str(engine_dir)), "workloads": [Path(w).name for w in workloads],
            "phases": phases, "phase_s": phase_s, "canary": canary, "max_prompt_tokens": max_prompt_tokens,
            "max_output_tokens": max_output_tokens, "seed": seed, "kv_cache_gib": kv_cache_gib,
            "profile_points": profile_points if "profile" in calibrations else None,
            "profile_max_decode_steps": profile_max_decode_steps if "profile" in calibrations else None,
        },  # fmt: skip
        "sessions": {
            name: {
                "run_id": sessions[name]["run_id"], "workload": sessions[name]["workload"]["path"],
                "n_steps": int(trace.n_steps), "n_canary_steps": int(canary_mask(trace).sum()),
                "n_requests": len(sessions[name]["requests"]),
                "n_failed_requests": sum(1 for r in sessions[name]["requests"] if r["status"] != 200),
                "traffic_s": sessions[name]["traffic_s"],
                "engine_fingerprints": trace.engine_fingerprint_ids(),
            }
            for name, trace in zip(SESSIONS, (calibration_trace, held_out_trace))
        },  # fmt: skip
        "ledger_steps": sessions["ledger_steps"],
        "calibrations": {name: {key: c.get(key) for key in ("mode", "fit", "coverage", "profile", "fingerprint_matches", "model_fingerprint")}
                         for name, c in calibrations.items()},
        "noise_floor": floor,
        "residuals": residuals,
        "goal": {
            "rule": f"held-out |relative residual| p50 <= {GOAL_RATIO} x the canary noise floor p50",
            "limit": GOAL_RATIO * floor["p50"],
            "met": {name: residuals[name]["all"]["abs_relative_residual_p50"] <= GOAL_RATIO * floor["p50"] for name in models},
        },
    }
    (out_dir / "calibration.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result


def ledger_line(result: dict) -> str:
    recorded = sum(session["n_steps"] for session in result["sessions"].values())
    if result["ledger_steps"] == recorded:
        return f"every step of both reached the ledger ({recorded:,})"
    return f"the ledger holds {result['ledger_steps']:,} of the {recorded:,} recorded steps"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def markdown_summary(result: dict) -> str:
    """The doc's figures (docs/recorder.md), generated from the result so they cannot drift from it."""
    floor, goal = result["noise_floor"], result["goal"]
    settings = result["settings"]
    sessions = result["sessions"]
    lines = [
        f"Two served sessions (phases of {', '.join(map(str, settings['phases']))} concurrent clients, "
        f"{settings['phase_s']:g} s each): calibration on `{sessions['calibration']['workload']}` "
        f"({sessions['calibration']['n_steps']:,} steps), held out on `{sessions['held-out']['workload']}` "
        f"({sessions['held-out']['n_steps']:,} steps, a new engine start); {ledger_line(result)}.",
        "",
        f"Noise floor (the canary's {floor['n_groups']} step compositions, {floor['n_steps']} steps over both sessions): "
        + (floor_text(floor) if floor.get("interval") else
           f"p50 {_pct(floor['p50'])}, p90 {_pct(floor['p90'])}, by the earlier statistic ({floor.get('definition', 'unstated')}), "
           "without an interval: this result predates the one floor (`llmvisor.core.stats.replicate_noise_floor`), and "
           "recomputing it needs the sessions re-measured")
        + f"; goal: held-out p50 within {GOAL_RATIO}× of it ({_pct(goal['limit'])}).",
        "",
    ]
    for name, calibration in result["calibrations"].items():
        fit = calibration["fit"]
        line = (f"- `{name}`: fitted on {fit['n_steps_used']:,} of {fit['n_steps_total']:,} {'profile' if name == 'profile' else 'live'} steps "
                f"({fit['n_warmup_dropped']} warm-up, {fit['n_drifted_dropped']} drifted, {fit['n_outliers_dropped']} outliers dropped), "
                f"in-sample p50 {_pct(fit['train_rel_err_p50'])}")
        if calibration.get("profile"):
            drift = calibration["profile"]["drift"]
            line += (f"; {drift['n_canary_runs']} drift canary runs, largest drift {_pct(drift['max_abs_drift'])}, "
                     f"{drift['n_drifted_canaries']} drifted; the profile's fingerprint "
                     f"{'matched' if calibration['fingerprint_matches'] else 'did not match'} the served one")
        lines.append(line)
    lines += [
        "",
        "| model | held-out \\|residual\\| p50 / p90 | signed p10 / p50 / p90 | decode-only p50 | with prefill p50 | goal |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, figures in result["residuals"].items():
        every = figures["all"]
        lines.append(
            f"| {MODEL_LABELS[name]} | {_pct(every['abs_relative_residual_p50'])} / {_pct(every['abs_relative_residual_p90'])} | "
            f"{every['relative_residual_p10']:+.1%} / {every['relative_residual_p50']:+.1%} / {every['relative_residual_p90']:+.1%} | "
            f"{_pct((figures['decode_only'] or {}).get('abs_relative_residual_p50'))} | "
            f"{_pct((figures['with_prefill'] or {}).get('abs_relative_residual_p50'))} | "
            f"{'met' if goal['met'][name] else 'not met'} |"
        )
    return "\n".join(lines)
