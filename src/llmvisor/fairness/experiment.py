"""Experiments on the real engine. ``fairness``: FCFS vs token VTC vs attributed VTC, per tenant over time.

Workload (stated, the same arrivals for every policy): every tenant sends requests of the same size, 64 new
prompt tokens and 64 output tokens by default, at the same Poisson rate, fast enough that every tenant is
backlogged. The long-context tenants' requests continue multi-turn conversations: each prompt is one
conversation's long history (prefilled once during warm-up, then served from vLLM's prefix cache) followed by
the 64 new tokens; conversations are continued in turn and outnumber the requests running at once, so running
requests never share a history. Per request they run the same tokens as everyone else, and VTC's token count
sees them as equal, but every prefill chunk attends over the history and every decode reads its KV cache. That
is the case the issue names: same request and token rate, more engine time.


Each policy runs in a fresh engine in its own process (`llmvisor.engines.vllm.fair_experiment`), recording the
step trace; `llmvisor.fairness.experiment_analysis` analyses every run alike, and `llmvisor.fairness.experiment_report`
draws and tabulates the result. This module runs the experiments and re-exports both modules' names.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from llmvisor import shipped
from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.model import StepLatencyModel
from llmvisor.engine_process import run_engine_module
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.experiment_analysis import (
    GOAL_JAIN,
    GOAL_MAX_MIN,
    GOAL_THROUGHPUT_LOSS,
    SLO_RUN,
    admission,
    admission_over_seeds,
    analyse_run,
    completion_rates,
    goals,
    insitu_check,
    model_free,
    model_free_goals,
    slo_figures,
)
from llmvisor.fairness.experiment_report import (
    POLICY_LABELS,
    admission_markdown_summary,
    format_seconds,
    markdown_summary,
    plot,
    plot_admission,
    report_sections,
)
from llmvisor.fairness.policy import POLICIES

TIME_POLICIES = ("fcfs", "tokens", "attributed")
"""The policies `llmvisor experiment fairness` runs by default (its set-up is bound by engine time; DRF is compared
where memory binds, `llmvisor.fairness.memory_experiment`)."""

__all__ = [
    "ADMISSION_FORMAT", "ALONE_PREFIX", "GOAL_JAIN", "GOAL_MAX_MIN", "GOAL_THROUGHPUT_LOSS", "POLICIES", "POLICY_LABELS",
    "SLO_RUN", "TIME_POLICIES", "admission", "admission_markdown_summary", "admission_over_seeds", "alone_workload", "analyse_run",
    "charge_model_path", "completion_rates", "format_seconds", "goals", "insitu_check", "markdown_summary", "model_free",
    "model_free_goals", "plot", "plot_admission", "report_sections", "run_admission_experiment", "run_experiment",
    "run_policy", "slo_figures", "workload_tenants",
]


def workload_tenants(
    n_tenants: int,
    *,
    rate_rps: float,
    history_tokens: int,
    n_conversations: int,
    prompt_tokens: int,
    output_tokens: int,
    shared_documents: int = 0,
) -> list[dict]:
    """Alternating long-context and short-context tenants: long, short, long-2, short-2; with
    ``shared_documents`` > 0 also a tenant "shared" whose requests continue one of that many documents, so its
    running requests read the same cached KV blocks (retrieval over a few documents, one long system prompt)."""
    if not 2 <= n_tenants <= 4:
        raise LlmvisorError(f"--tenants must be 2 to 4 (got {n_tenants})")
    if shared_documents < 0:
        raise LlmvisorError(f"--shared-documents must be >= 0 (got {shared_documents})")
    tenants = []
    for k in range(n_tenants):
        long = k % 2 == 0
        suffix = "" if k < 2 else "-2"
        tenants.append(
            {
                "name": ("long" if long else "short") + suffix,
                "rate_rps": rate_rps,
                "history_tokens": history_tokens if long else 0,
                "n_conversations": n_conversations if long else 0,
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
            }
        )
    if shared_documents:
        tenants.append(
            {
                "name": "shared",
                "rate_rps": rate_rps,
                "history_tokens": history_tokens,
                "n_conversations": shared_documents,
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
            }
        )
    return tenants


ALONE_PREFIX = "alone-"


def alone_workload(workload: dict, tenant_name: str) -> dict:
    """One tenant's requests alone, arriving at the whole experiment's offered rate (every tenant's rate summed):
    the tenant stays backlogged alone as it was under contention, so its completion rate alone is what the
    engine gives it when it has the engine to itself."""
    tenants = workload["tenants"]
    tenant = next((t for t in tenants if t["name"] == tenant_name), None)
    if tenant is None:
        raise LlmvisorError(f"no tenant {tenant_name!r} in the workload")
    return {**workload, "tenants": [{**tenant, "rate_rps": float(sum(t["rate_rps"] for t in tenants))}]}


# ------------------------------------------------------------------------------------------------ command


def run_policy(spec: dict, log_path: Path) -> dict:
    """One policy in a fresh process; its result dict."""
    out_dir = Path(spec["out_dir"])
    return run_engine_module("llmvisor.engines.vllm.fair_experiment", spec, spec_path=out_dir / "spec.json",
                             result_path=out_dir / "result.json", log_path=log_path, what=f"policy {spec['policy']}: the engine run")


def load_run(out_dir: Path, name: str) -> dict:
    """A run's result.json as the engine run wrote it (``--analyse-only``); refused in one line when it is missing."""
    if not (out_dir / "result.json").is_file():
        raise LlmvisorError(f"--analyse-only: {out_dir / 'result.json'} not found; run {name} first")
    return json.loads((out_dir / "result.json").read_text())


def charge_model_path(latency_model_path: Path | None) -> str:
    """The latency model an experiment charges and predicts with (``--model``; None: the shipped one), refused in
    one line when the file is missing."""
    model_path = str(latency_model_path if latency_model_path is not None else shipped.latency_model_path())
    if not os.path.exists(model_path):
        raise LlmvisorError(f"--model: {model_path} not found; fit one with `llmvisor fit TRACE -o model.json`")
    return model_path


def run_experiment(
    output: Path,
    *,
    latency_model_path: Path | None,
    engine_dir: Path,
    engine: dict,
    policies: list[str],
    workload: dict,
    window_s: float,
    warmup_s: float,
    alone: bool = True,
    tpot_slo_s: float | None = None,
    analyse_only: bool = False,
    progress=None,
) -> dict:
    """Run each policy in its own engine process (or re-read its run), analyse all alike, write fairness.json/png.

    ``engine`` holds the `EngineSettings` fields other than the engine model; ``workload`` is
    ``{"tenants": workload_tenants(...), "duration_s": ..., "seed": ...}``. With ``alone``, each tenant also runs
    alone (`alone_workload`) for the model-free fairness figures; with ``tpot_slo_s``, attributed VTC runs once
    more with SLO admission control (`admission`).
    """

    say = progress or (lambda message: None)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise LlmvisorError(f"--policy: unknown {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    if tpot_slo_s is not None and not (math.isfinite(tpot_slo_s) and tpot_slo_s > 0):
        raise LlmvisorError(f"--tpot-slo-s: must be a positive number of seconds (got {tpot_slo_s})")
    if tpot_slo_s is not None and "attributed" not in policies:
        raise LlmvisorError("--tpot-slo-s: the admission comparison needs the attributed policy (add --policy attributed)")
    model_path = charge_model_path(latency_model_path)
    charge_model = StepLatencyModel.from_json(model_path)
    output.mkdir(parents=True, exist_ok=True)
    plan: list[tuple[str, str, dict, float | None]] = [(name, name, workload, None) for name in policies]
    if tpot_slo_s is not None:
        plan.append((SLO_RUN, "attributed", workload, tpot_slo_s))
    if alone:
        plan += [(ALONE_PREFIX + t["name"], "fcfs", alone_workload(workload, t["name"]), None) for t in workload["tenants"]]
    runs = {}
    for name, policy, run_workload, slo in plan:
        out_dir = output / name
        if analyse_only:
            runs[name] = load_run(out_dir, name)
            continue
        spec = {
            "policy": policy, "name": name, "tpot_slo_s": slo, "out_dir": str(out_dir), "model_dir": str(engine_dir),
            "model_path": model_path, "engine": engine, "workload": run_workload,
        }
        say(f"running {name} for {run_workload['duration_s']:.0f} s (+ engine start) …")
        started = time.perf_counter()
        runs[name] = run_policy(spec, out_dir / "engine.log")
        overhead = runs[name].get("scheduler_overhead")
        extra = f"; scheduler's own work {100 * overhead['fraction_of_step_time']:.3f}% of step time ({overhead['added_time_per_step_us']:.0f} µs/step)" if overhead else ""
        say(f"  done in {time.perf_counter() - started:.0f} s{extra}")
    analysed_all = {name: analyse_run(run, charge_model, window_s=window_s, warmup_s=warmup_s) for name, run in runs.items()}
    analysed = {name: analysed_all[name] for name in policies}
    alone_runs = {name.removeprefix(ALONE_PREFIX): analysed_all[name] for name in runs if name.startswith(ALONE_PREFIX)}
    if alone_runs:
        alone_summaries = {tenant: data["summary"] for tenant, data in alone_runs.items()}
        for data in analysed.values():
            data["model_free"] = model_free(data["summary"], alone_summaries)
    first = runs[policies[0]]
    check = insitu_check({name: runs[name] for name in policies}, window_s=window_s, warmup_s=warmup_s)
    result = {
        "experiment": "fairness",
        "setup": {
            "model": os.path.basename(model_path),
            "engine_model": os.path.basename(os.path.normpath(str(engine_dir))),
            "engine": {**first["engine"], "model": os.path.basename(os.path.normpath(first["engine"]["model"]))},
            "workload": first["workload"],
            "window_s": window_s,
            "warmup_s": warmup_s,
            "attribution_rule": "shapley",
            "model_boundary_new_tokens": charge_model.boundary_,
            "model_coef_s": [dict(zip(FEATURE_NAMES, map(float, row))) for row in charge_model.coef_],
            "hardware": machine_description(),
            "alone_rule": "each tenant alone, arriving at the experiment's total offered rate (every tenant's rate summed), vLLM's FCFS scheduler",
        },
        "policies": analysed,
        "goals": goals(analysed),
        "insitu_check": check,
    }
    if alone_runs:
        result["alone"] = {
            tenant: {
                "workload": runs[ALONE_PREFIX + tenant]["workload"],
                "completions_per_s": completion_rates(data["summary"])[tenant],
                "backlogged_throughout": tenant in data["summary"]["backlogged_throughout"],
                "summary": data["summary"],
            }
            for tenant, data in alone_runs.items()
        }
        result["goals"].update(model_free_goals(analysed))
    if SLO_RUN in runs:
        with_slo = analysed_all[SLO_RUN]
        result["admission"] = admission(analysed["attributed"], with_slo, runs, tpot_slo_s if tpot_slo_s is not None else runs[SLO_RUN]["tpot_slo_s"])
        result["admission"]["run_summary"] = with_slo["summary"]
        result["admission"]["scheduler_overhead"] = with_slo.get("scheduler_overhead")
    (output / "fairness.json").write_text(json.dumps(result, indent=2) + "\n")
    figure = plot(result)
    figure.savefig(output / "fairness.png", dpi=110, bbox_inches="tight")
    if "admission" in result:
        plot_admission(result).savefig(output / "admission.png", dpi=110, bbox_inches="tight")
    return result


def machine_description() -> str:
    """The CPU model and count the experiment ran on, for the result's setup."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return "unknown"


# ------------------------------------------------------------------------------------------------ admission, repeated

ADMISSION_FORMAT = "llmvisor.admission"


def run_admission_experiment(
    output: Path,
    *,
    latency_model_path: Path | None,
    engine_dir: Path,
    engine: dict,
    workload: dict,
    seeds: list[int],
    tpot_slo_s: float,
    tpot_prediction_factor: float | None,
    prediction_factor_source: str,
    window_s: float,
    warmup_s: float,
    analyse_only: bool = False,
    progress=None,
) -> dict:
    """SLO admission repeated: for each seed, attributed VTC without and with admission control at ``tpot_slo_s``
    on the same arrivals (the seed draws arrivals, prompts and the engine's sampling), each run in a fresh engine
    process as `run_experiment` runs them; the predictions scaled by ``tpot_prediction_factor`` (None: the model's
    training factor). Writes admission.json: each seed's `admission` figures and `admission_over_seeds`."""
    say = progress or (lambda message: None)
    if not seeds or len(set(seeds)) != len(seeds):
        raise LlmvisorError(f"--seeds: one or more distinct seeds (got {seeds})")
    if not (math.isfinite(tpot_slo_s) and tpot_slo_s > 0):
        raise LlmvisorError(f"--tpot-slo-s: must be a positive number of seconds (got {tpot_slo_s})")
    if tpot_prediction_factor is not None and not (math.isfinite(tpot_prediction_factor) and tpot_prediction_factor > 0):
        raise LlmvisorError(f"--tpot-prediction-factor: must be a positive number (got {tpot_prediction_factor})")
    model_path = charge_model_path(latency_model_path)
    charge_model = StepLatencyModel.from_json(model_path)
    output.mkdir(parents=True, exist_ok=True)
    per_seed: dict[int, dict] = {}
    for seed in seeds:
        runs = {}
        seed_workload = {**workload, "seed": seed}
        for name, slo in (("attributed", None), (SLO_RUN, tpot_slo_s)):
            out_dir = output / f"seed-{seed}" / name
            if analyse_only:
                runs[name] = load_run(out_dir, name)
                continue
            spec = {"policy": "attributed", "name": name, "tpot_slo_s": slo, "out_dir": str(out_dir), "model_dir": str(engine_dir),
                    "model_path": model_path, "engine": {**engine, "seed": seed}, "workload": seed_workload,
                    "tpot_prediction_factor": tpot_prediction_factor if slo is not None else None}
            say(f"seed {seed}: running {name} for {seed_workload['duration_s']:.0f} s (+ engine start) …")
            started = time.perf_counter()
            runs[name] = run_policy(spec, out_dir / "engine.log")
            say(f"  done in {time.perf_counter() - started:.0f} s")
        analysed = {name: analyse_run(run, charge_model, window_s=window_s, warmup_s=warmup_s) for name, run in runs.items()}
        per_seed[seed] = admission(analysed["attributed"], analysed[SLO_RUN], runs, tpot_slo_s)
    factors = {r["tpot_prediction_factor"] for r in per_seed.values()}
    result = {
        "format": ADMISSION_FORMAT,
        "experiment": "admission",
        "setup": {
            "model": os.path.basename(model_path),
            "engine_model": os.path.basename(os.path.normpath(str(engine_dir))),
            "engine": engine, "workload": workload, "window_s": window_s, "warmup_s": warmup_s, "hardware": machine_description(),
            "tpot_slo_s": tpot_slo_s, "seeds": list(seeds),
            "tpot_prediction_factor": tpot_prediction_factor, "prediction_factor_source": prediction_factor_source,
            "factor_applied": sorted(f for f in factors if f is not None),
        },
        "per_seed": {str(seed): r for seed, r in per_seed.items()},
        "over_seeds": admission_over_seeds(per_seed),
    }
    (output / "admission.json").write_text(json.dumps(result, indent=2) + "\n")
    return result

