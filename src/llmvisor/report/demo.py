"""The end-to-end demo on the shipped traces recorded from vLLM: fit, held-out evaluation, attribution, report."""

from __future__ import annotations

import json
from pathlib import Path

from llmvisor.core.attribution import RULES, aggregate, attribute
from llmvisor.core.game import VTC_TOKEN_PRICES
from llmvisor.core.trace import StepTrace, read_trace, read_traces
from llmvisor.evaluation.heldout import evaluate, to_json_ready
from llmvisor.report.html import (
    boundary_search_plot,
    coverage_plots,
    error_cdfs,
    json_links,
    metrics_table,
    model_coefficients_table,
    predicted_vs_measured,
    step_counts_note,
    tenant_bars,
    write_report,
)
from llmvisor.shipped import (
    FAIRNESS_RESULT,
    HELD_OUT_TRACES,
    MULTI_TENANT_TRACE,
    TRAIN_TRACE,
    VALIDATION_RESULT,
    result_path,
    trace_path,
)
from llmvisor.validation.report import report_sections as validation_sections


def token_service(trace: StepTrace) -> dict[str, float]:
    """VTC's token service per tenant (prompt tokens ×1, output tokens ×2), for comparison with engine time."""
    weight = VTC_TOKEN_PRICES.slice_costs(trace.num_new_tokens, trace.is_prefill)
    totals: dict[str, float] = {}
    for tenant, value in zip(trace.tenant.tolist(), weight.tolist()):
        totals[tenant] = totals.get(tenant, 0.0) + value
    return totals


def run_demo(output_dir: Path, *, n_bootstrap: int = 1000, progress=None) -> dict:
    step = progress or (lambda message: None)
    step("reading shipped traces")
    train = read_trace(trace_path(TRAIN_TRACE))
    test = read_traces([trace_path(name) for name in HELD_OUT_TRACES])
    step("fitting llmvisor and baselines on the sweep, evaluating on held-out workloads")
    result = evaluate(train, test, n_bootstrap=n_bootstrap)
    model = result["fitted"]["llmvisor"]
    output_dir.mkdir(parents=True, exist_ok=True)
    model.to_json(output_dir / "model.json")

    step("attributing the multi-tenant run")
    tenants_trace = read_trace(trace_path(MULTI_TENANT_TRACE))
    by_rule = {rule: aggregate(tenants_trace, attribute(model, tenants_trace, rule), "tenant") for rule in RULES}
    tokens = token_service(tenants_trace)
    measured_s = float(tenants_trace.step_latency_s_per_step.sum())
    token_total = sum(tokens.values())
    by_rule_plus_tokens = dict(by_rule)
    by_rule_plus_tokens["token share (VTC)"] = {t: measured_s * v / token_total for t, v in tokens.items()}

    summary = {
        "evaluation": to_json_ready(result),
        "model": model.to_dict(),
        "attribution": {
            "trace": MULTI_TENANT_TRACE,
            "total_measured_s": measured_s,
            "by_rule": by_rule,
            "token_service": tokens,
        },
    }
    validation_path = result_path(VALIDATION_RESULT)
    validation = json.loads(validation_path.read_text()) if validation_path.is_file() else None
    if validation is not None:
        summary["validation"] = validation.get("summary", validation)

    step("writing the report")
    coverage = train.metadata.get("coverage")
    model_dict = model.to_dict()
    files = {
        "model.json": ("the fitted latency model (load it with StepLatencyModel.from_json)", None),
        "summary.json": ("evaluation, attribution and validation figures of this report", None),
        "coverage.json": ("the sweep's coverage of the engine envelope (quantiles, step kinds, reach)", coverage),
        "boundary_search.json": ("cross-validated error of every candidate segment boundary", model.fit_info_.get("boundary_search")),
    }
    extra_files = {name: content for name, (_, content) in files.items() if content is not None}
    links = {name: what for name, (what, content) in files.items() if content is not None or name in ("model.json", "summary.json")}
    sections = [
        (
            "What this is",
            "<p>llmvisor fitted on the shipped sweep trace (recorded from the vLLM CPU build) and judged on held-out "
            f"workload runs it never saw: {', '.join(result['test_runs'])}. Errors are |predicted − measured| / measured per "
            "step; intervals are bootstrap 95%. Warm-up steps are excluded from judging and counted.</p>"
            + step_counts_note(train, model.fit_info_, coverage),
        ),
        ("Held-out step-latency error", metrics_table(result) + _improvement_html(result) + _noise_html(result)),
        ("Predicted vs measured", predicted_vs_measured(result, test)),
        ("Error CDFs (with the noise floor of re-measuring identical steps)", error_cdfs(result, test)),
        (
            "Attributed engine time per tenant (multi-tenant run)",
            tenant_bars(by_rule_plus_tokens, "engine time per tenant by rule")
            + "<p class='note'>shapley: own terms + equal split of the intercept, residual scaled so shares sum to the "
            "measured time; proportional: intercept follows own terms; paper: own terms only (intercept and residual "
            "unattributed); token share: the measured time split by VTC's token counts.</p>",
        ),
        ("Latency model: coefficients", model_coefficients_table(model_dict)),
        ("Latency model: segment boundary search", boundary_search_plot(model.fit_info_)),
    ]
    if coverage:
        sections.insert(2, ("Sweep coverage of the engine envelope", coverage_plots(train, train.metadata.get("engine"))))
    if validation is not None:
        sections.extend(validation_sections(validation))
    fairness_path = result_path(FAIRNESS_RESULT)
    if fairness_path.is_file():
        from llmvisor.fairness.experiment import report_sections as fairness_sections

        fairness = json.loads(fairness_path.read_text())
        sections.extend(fairness_sections(fairness))
        extra_files["fairness.json"] = fairness
        links["fairness.json"] = "the fairness experiment's result (per policy, per tenant, per window)"
    sections.append(("Raw data (JSON, next to this page)", json_links(links)))
    report = write_report(output_dir, sections, title="llmvisor demo on shipped vLLM traces", data=summary, files=extra_files)
    return {"result": result, "summary": summary, "report": report, "model": model, "by_rule": by_rule_plus_tokens}


def _improvement_html(result: dict) -> str:
    parts = [
        f"{phase}: p90 {v['p90']:.2f}×, p99 {v['p99']:.2f}×" for phase, v in result.get("improvement", {}).items() if v["p90"]
    ]
    return f"<p>Improvement over token_count (its error ÷ llmvisor's): {'; '.join(parts)}</p>" if parts else ""


def _noise_html(result: dict) -> str:
    floors = [
        f"{which}: p50 {f['p50']:.1%}, p90 {f['p90']:.1%}, p99 {f['p99']:.1%}"
        for which, f in (result.get("noise_floor") or {}).items()
        if f
    ]
    return f"<p>Noise floor (re-measuring identical steps): {'; '.join(floors) or 'not measured'}</p>"
