"""`llmvisor calibrate`: a latency model of the engine exactly as it is served.

Two ways, one output (a model file whose ``engine_fingerprint`` is the served engine's):

- ``--fingerprint`` (the served engine's record: ``<trace>.engine.json`` the recorder wrote, a trace beside
  it, or a Parquet trace): run ``llmvisor profile --plan sweep`` with the served engine's settings (batch
  limits, dtype, prefix caching, eager mode, the executor: a worker process bound to the served worker's cores,
  or this process pinned to them with its thread count), with drift canaries; fit on the sweep (drifted
  steps left out); check the profile's fingerprint id is the served one. When drift leaves too few steps,
  profile again (``--attempts``, a new engine start each) and fit on the steady steps of all the profiles,
  less any profile whose machine level differs from the median profile's (`profile_level_drift`).
- ``--from-trace``: fit on the live steps the recorder collected, once they meet the coverage rule
  (`llmvisor.profile.calibration`).

Either way the fit must keep enough steps after its warm-up, drift and outlier rules, per phase and per step
kind covered (`llmvisor.profile.calibration.fit_usable`); below that it refuses (exit 2, one line naming the
counts, no model written) unless ``--allow-few-steps``, which writes the model with a loud warning.

``--evaluate-on`` a served run reports the relative residuals of the baseline model (default: the shipped
one) and of the calibrated model on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from llmvisor import shipped
from llmvisor.cli.console import stderr
from llmvisor.cli.params import check_output_file
from llmvisor.core.fingerprint import EngineFingerprint, describe_mismatch
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import concat_traces, read_trace, read_traces
from llmvisor.errors import LlmvisorError
from llmvisor.profile.calibration import describe_short_fit, fit_usable, live_coverage, read_fingerprint, residual_quantiles
from llmvisor.profile.drift import mark_drifted, profile_level_drift


def calibrate(
    output: Annotated[Path, typer.Option("--output", "-o", help="Latency model file to write (JSON).", dir_okay=False, metavar="FILE")],
    fingerprint: Annotated[Path | None, typer.Option(help="The served engine's fingerprint: <trace>.engine.json, the trace beside it, or a Parquet trace. Profiles with its settings.", dir_okay=False, metavar="FILE")] = None,
    from_trace: Annotated[list[Path] | None, typer.Option(help="Fit on these live traces of the served engine instead of profiling (they must meet the coverage rule).", dir_okay=False, metavar="TRACE")] = None,
    engine_model: Annotated[Path | None, typer.Option(help="Profile: the engine model folder the server runs. Default: the shipped engine model.", file_okay=False, metavar="DIR")] = None,
    points: Annotated[int, typer.Option(help="Profile: sweep episodes.", min=1)] = 24,
    max_decode_steps: Annotated[int, typer.Option(help="Profile: most decode steps of an episode.", min=1)] = 24,
    max_episode_tokens: Annotated[int, typer.Option(help="Profile: most prompt tokens of an episode (keeps episodes short; the engine's own limits stay the served ones).", min=1)] = 16384,
    canary_every: Annotated[int, typer.Option(help="Profile: a drift canary after every this many episodes.", min=0)] = 2,
    attempts: Annotated[int, typer.Option(help="Profile: when drift leaves too few steps to fit, profile again (a new engine start) "
                                          "up to this many profiles in all, and fit on the steady steps of all of them.", min=1)] = 3,
    kv_cache_gib: Annotated[int, typer.Option(help="Profile: KV cache GiB (vLLM CPU build).", min=1)] = 2,
    trace_output: Annotated[Path | None, typer.Option(help="Profile: where to keep the sweep trace. Default: beside the model, .profile.parquet.", dir_okay=False, metavar="FILE")] = None,
    evaluate_on: Annotated[Path | None, typer.Option(help="A served run's trace: report residuals of the baseline and the calibrated model on it.", dir_okay=False, metavar="TRACE")] = None,
    baseline_model: Annotated[Path | None, typer.Option(help="The model the served run was attributed with before. Default: the shipped latency model.", dir_okay=False, metavar="FILE")] = None,
    allow_few_steps: Annotated[bool, typer.Option(help="Write the model even when the fit keeps fewer steps than the fit rule asks "
                                                  "(per phase and step kind, after the warm-up, drift and outlier rules), with a warning.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    """Fit a latency model to the engine as it is served (profile it with the served settings, or fit on its live steps)."""
    if (fingerprint is None) == (not from_trace):
        raise LlmvisorError("calibrate: give either --fingerprint (profile the served engine) or --from-trace (fit on its live steps)")
    check_output_file(output)
    result: dict = {"output": str(output)}
    if fingerprint is not None:
        served = read_fingerprint(fingerprint)
        trace_path = check_output_file(trace_output or output.with_suffix(".profile.parquet"), "--trace-output")
        paths = [trace_path] + [check_output_file(attempt_path(trace_path, k), "--trace-output") for k in range(2, attempts + 1)]
        result["served_fingerprint"] = served.to_dict()
        result["mode"] = "profile"
        result["profiles"], traces = [], []
        for k, path in enumerate(paths, start=1):
            summary = run_profile(served, path, engine_model=engine_model, points=points, max_decode_steps=max_decode_steps,
                                  max_episode_tokens=max_episode_tokens, canary_every=canary_every, kv_cache_gib=kv_cache_gib)
            result["profiles"].append({"trace": str(path), **summary})
            traces.append(read_trace(path))
            trace, result["level_drift"] = combine_profiles(traces)
            try:
                model = StepLatencyModel().fit(trace)
            except LlmvisorError as error:  # e.g. every step drifted
                if k == len(paths):
                    raise LlmvisorError(f"calibrate: {error}; no model written: profile again while nothing else runs") from None
                why = str(error)
            else:
                usable = fit_usable(model, trace)
                if not usable["short"] or k == len(paths):
                    break
                why = describe_short_fit(usable)
            stderr.print(f"calibrate: profile {k} of at most {len(paths)}: {why}; profiling again "
                         "(the steady steps of every profile are fitted together)", highlight=False)
        result["profile"], result["profile_trace"] = result["profiles"][0], str(trace_path)
    else:
        trace = read_traces(from_trace)
        coverage = live_coverage(trace)
        result["mode"] = "live"
        result["coverage"] = coverage
        if coverage["missing"]:
            raise LlmvisorError(
                f"{', '.join(map(str, from_trace))}: the live steps do not cover the engine's envelope yet: "
                f"{'; '.join(coverage['missing'])}; profile instead (--fingerprint)"
            )
        served = None
        model = StepLatencyModel().fit(trace)
        usable = fit_usable(model, trace)
    result["usable"] = usable
    if usable["short"] and not allow_few_steps:
        raise LlmvisorError(f"calibrate: {describe_short_fit(usable)}; no model written: profile again while nothing else "
                            "runs (or with more --points), or give --allow-few-steps to write it anyway")
    if usable["short"]:
        stderr.print(f"[bold red]warning: fitted on too few steps[/] (--allow-few-steps): {describe_short_fit(usable)}; "
                     "this model extrapolates, do not bill with it unchecked", highlight=False)
    model.to_json(output)
    info = model.fit_info_
    result["fit"] = {key: info[key] for key in ("n_steps_total", "n_steps_used", "n_warmup_dropped", "n_drifted_dropped",
                                                  "n_outliers_dropped", "train_rel_err_p50", "train_rel_err_p90")}
    result["model_fingerprint"] = model.engine_fingerprint_
    if served is not None:
        matches = (model.engine_fingerprint_ or {}).get("id") == served.id
        result["fingerprint_matches"] = matches
        if not matches:
            stderr.print(f"[yellow]warning:[/] the profile ran on another engine than the served one: "
                         f"{describe_mismatch(model.engine_fingerprint_, served.to_dict())}", highlight=False)
    if evaluate_on is not None:
        result["evaluation"] = evaluate(evaluate_on, baseline_model, model)
    if json_output:
        typer.echo(json.dumps(result, indent=2, default=str))
        return
    stderr.print(
        f"fitted on {info['n_steps_used']} of {info['n_steps_total']} steps ({info['n_warmup_dropped']} warm-up, "
        f"{info['n_drifted_dropped']} drifted, {info['n_outliers_dropped']} outliers dropped); "
        f"engine fingerprint {(model.engine_fingerprint_ or {}).get('id')}; wrote {output}", highlight=False,
    )
    if "evaluation" in result:
        for name, figures in result["evaluation"]["models"].items():
            stderr.print(f"{name}: |relative residual| p50 {figures['abs_relative_residual_p50']:.1%}, "
                         f"p90 {figures['abs_relative_residual_p90']:.1%} over {figures['n_steps']} steps", highlight=False)


def profile_command(served: EngineFingerprint, trace_path: Path, *, engine_model: Path | None, points: int,
                    max_decode_steps: int, canary_every: int, kv_cache_gib: int, max_episode_tokens: int = 16384) -> list[str]:
    """``llmvisor profile --plan sweep`` with the served engine's settings, on its model worker's cores."""
    command = [
        sys.executable, "-m", "llmvisor.cli", "profile", "--plan", "sweep", "--output", str(trace_path),
        "--engine-model", str(engine_model or shipped.engine_model_dir()),
        "--max-num-batched-tokens", str(served.max_num_batched_tokens), "--max-num-seqs", str(served.max_num_seqs),
        "--points", str(points), "--max-decode-steps", str(max_decode_steps), "--max-episode-tokens", str(max_episode_tokens),
        "--canary-every", str(canary_every),
        "--kv-cache-gib", str(kv_cache_gib), "--enforce-eager" if served.enforce_eager else "--no-enforce-eager",
        "--prefix-caching" if served.enable_prefix_caching else "--no-prefix-caching", "--json",
    ]
    if served.max_model_len:
        command += ["--max-model-len", str(served.max_model_len)]
    if served.dtype:  # the dtype vLLM resolved for the served engine: a float32-served class is profiled in float32
        command += ["--dtype", served.dtype]
    if served.executor_backend == "mp":
        command += ["--executor", "mp"]  # the worker process, bound by vLLM to the cores of profile_environment
    else:
        if served.threads:
            command += ["--threads", str(served.threads)]
        if served.core_ids:
            command += ["--cores", ",".join(map(str, served.core_ids))]
    return command


def profile_environment(served: EngineFingerprint, environ: dict[str, str]) -> dict[str, str]:
    """The profile's environment: with a worker process, vLLM's CPU build binds it to the served worker's cores."""
    env = dict(environ)
    if served.executor_backend == "mp" and served.core_ids:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, served.core_ids))
    return env


def run_profile(served: EngineFingerprint, trace_path: Path, **options) -> dict:
    command = profile_command(served, trace_path, **options)
    stderr.print(f"profiling the served engine's settings: {' '.join(command[1:])}", highlight=False)
    stderr.print("the profile prints its progress and an estimate of the time left from its first measured episodes "
                 "(the duration depends on the machine: a CPU without oneDNN's bfloat16 kernels is many times slower)", highlight=False)
    done = subprocess.run(command, stdout=subprocess.PIPE, check=False, env=profile_environment(served, dict(os.environ)))
    if done.returncode != 0:
        raise LlmvisorError(f"calibrate: the profile failed (exit {done.returncode}); its messages are above")
    summary = json.loads(done.stdout)
    return {key: summary.get(key) for key in ("n_steps", "n_warmup_steps", "drift", "wall_time_s", "coverage")}


def attempt_path(trace_path: Path, attempt: int) -> Path:
    """Where profile ``attempt`` (2, 3, ...) keeps its trace: beside the first, ``.attempt-<k>`` before the suffix."""
    return trace_path.with_name(f"{trace_path.stem}.attempt-{attempt}{trace_path.suffix}")


def combine_profiles(traces: list) -> tuple:
    """The profiles as one trace to fit on, and the level-drift summary: a profile whose machine level differs
    from the median profile's (`llmvisor.profile.drift.profile_level_drift`) has all its steps flagged
    ``is_drifted``; each profile's own canary flags stay."""
    drifted, summary = profile_level_drift(traces)
    flagged = []
    for trace, whole in zip(traces, drifted):
        copy = dataclasses.replace(trace, extra=dict(trace.extra))  # the profile read keeps its own flags
        mark_drifted(copy, trace.is_drifted_per_step | whole)  # every profile has the column, or concat drops it
        flagged.append(copy)
    return concat_traces(flagged), summary


def evaluate(served_trace: Path, baseline_model: Path | None, calibrated: StepLatencyModel) -> dict:
    baseline_path = baseline_model or shipped.latency_model_path()
    trace = read_trace(served_trace)
    baseline = StepLatencyModel.from_json(baseline_path)
    ids = trace.engine_fingerprint_ids()
    return {
        "served_trace": str(served_trace),
        "served_fingerprints": ids,
        "baseline_model": shipped.portable_path(str(baseline_path)),
        "baseline_fingerprint": (baseline.engine_fingerprint_ or {}).get("id"),
        "calibrated_fingerprint": (calibrated.engine_fingerprint_ or {}).get("id"),
        "models": {"baseline": residual_quantiles(baseline, trace), "calibrated": residual_quantiles(calibrated, trace)},
    }
