"""Every figure the README and the docs quote comes from a JSON file that a command wrote; these tests tie each
quoted figure to its file, and the demo's file to what the demo computes now, so the three cannot drift.

When a figure changes, rerun the command that writes its file (the README's Results section names them) and
copy the figures this test reports as missing into the text.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from llmvisor import shipped
from llmvisor.fairness.experiment import markdown_summary as fairness_markdown_summary
from llmvisor.fairness.experiment_report import POLICY_LABELS
from llmvisor.fairness.fleet_experiment import markdown_summary as fleet_markdown_summary
from llmvisor.fairness.memory_experiment import memory_goals
from llmvisor.fairness.memory_report import markdown_summary as memory_markdown_summary
from llmvisor.profile.calibration_experiment import markdown_summary as calibration_markdown_summary
from llmvisor.service.fleet import PROBE_TIMEOUT_S
from llmvisor.validation.report import markdown_summary

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
MODEL_ROWS = {"llmvisor": "llmvisor", "paper_ols": "paper_ols", "token_count": "token_count (VTC cost)", "random_forest": "random_forest"}


# Baselines whose figures come from a library's estimator, not our own arithmetic: recomputed, they match the shipped
# file at the precision the README prints (a forest's trees depend on the scikit-learn release); the rest match exactly.
LIBRARY_MODELS = ("random_forest",)


def readme_cells(phase_figures: dict) -> list[str]:
    """One phase's cells of the README's error table, as printed."""
    return [*(pct(phase_figures[f"rel_err_{q}"]) for q in ("p50", "p90", "p99")), signed_pct(phase_figures["signed_err_p50"])]


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def signed_pct(value: float) -> str:
    return f"{100 * value:+.1f}%".replace("+-", "-")


def thousands(value: float) -> str:
    return f"{round(value):,}"


def ci(pair: list[float]) -> str:
    return f"[{100 * pair[0]:.1f}%, {100 * pair[1]:.1f}%]"


def signed_ci(pair: list[float]) -> str:
    return "[" + ", ".join(signed_pct(v) for v in pair) + "]"


def with_ci(m: dict, key: str) -> str:
    return f"{pct(m[key])} {ci(m[key + '_ci95'])}"


def heldout_interval_table(evaluation: dict) -> list[str]:
    """The README's held-out table with every figure's 95% block-bootstrap interval."""
    rows = []
    for name, label in MODEL_ROWS.items():
        cells = []
        for phase in ("prefill", "decode"):
            m = evaluation["models"][name][phase]
            cells += [" / ".join(with_ci(m, f"rel_err_p{q}") for q in (50, 90, 99)),
                      f"{signed_pct(m['signed_err_p50'])} {signed_ci(m['signed_err_p50_ci95'])}"]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def per_run_table(evaluation: dict) -> list[str]:
    """One row per held-out run: llmvisor's p50 / p90 [interval] / p99 and token_count's p90, per phase."""
    rows = []
    for run, models in evaluation["by_run"].items():
        cells = []
        for phase in ("prefill", "decode"):
            ours, tokens = models["llmvisor"][phase], models["token_count"][phase]
            cells += [thousands(ours["n_steps"]), f"{pct(ours['rel_err_p50'])} / {with_ci(ours, 'rel_err_p90')} / {pct(ours['rel_err_p99'])}",
                      with_ci(tokens, "rel_err_p90")]
        rows.append(f"| `{run}` | " + " | ".join(cells) + " |")
    return rows


def established(ours: dict, theirs: dict, key: str) -> bool:
    """llmvisor is shown better than the baseline at ``key`` only where the two 95% intervals do not overlap."""
    return ours[key + "_ci95"][1] < theirs[key + "_ci95"][0]


def improvement_sentence(evaluation: dict) -> str:
    """token_count's error over llmvisor's, stated as established only where the intervals support it."""
    parts = []
    for phase in ("prefill", "decode"):
        ours, theirs = evaluation["models"]["llmvisor"][phase], evaluation["models"]["token_count"][phase]
        for q in (90, 99):
            key, gain = f"rel_err_p{q}", evaluation["improvement"][phase][f"p{q}"]
            verdict = "intervals apart" if established(ours, theirs, key) else "intervals overlap: not established"
            parts.append(f"{phase} {gain:.1f}× at p{q} ({ci(ours[key + '_ci95'])} vs {ci(theirs[key + '_ci95'])}, {verdict})")
    return "; ".join(parts)


def floor_cells(floor: dict) -> str:
    return " / ".join(f"{pct(floor[q])} {ci(floor['interval'][q])}" for q in ("p50", "p90", "p99"))


def floor_sentence(evaluation: dict) -> str:
    """Both floors `llmvisor eval` computes from the traces, and whether llmvisor's prefill p99 is above them."""
    train, test = evaluation["noise_floor"]["train"], evaluation["noise_floor"]["test"]
    p99 = evaluation["models"]["llmvisor"]["prefill"]
    above = all(p99["rel_err_p99_ci95"][0] > floor["interval"]["p99"][1] for floor in (train, test))
    return (f"on the training sweep's repeated steps {floor_cells(train)} ({thousands(train['n_groups'])} compositions, "
            f"{thousands(train['n_steps'])} steps); on the test runs {floor_cells(test)} ({thousands(test['n_groups'])} compositions, "
            f"{thousands(test['n_steps'])} steps). llmvisor's prefill p99 ({with_ci(p99, 'rel_err_p99')}) lies "
            + ("above both floors' p99 intervals" if above else "within a floor's p99 interval"))


def demo_figures(demo: dict) -> list[str]:
    evaluation, fit = demo["evaluation"], demo["model"]["fit_info"]
    figures = [
        f"Fitted on the shipped sweep ({thousands(fit['n_steps_total'])} steps",
        f"{thousands(fit['n_warmup_dropped'])} warm-up, {thousands(fit.get('n_drifted_dropped', 0))} drifted and "
        f"{thousands(fit['n_outliers_dropped'])} outlier steps dropped",
        f"{thousands(fit['n_steps_used'])} used",
        f"{thousands(evaluation['models']['llmvisor']['all']['n_steps'])} steady steps)",
    ]
    figures += heldout_interval_table(evaluation)
    figures += per_run_table(evaluation)
    figures.append(improvement_sentence(evaluation))
    figures.append(floor_sentence(evaluation))
    sharing = evaluation["by_sharing"]
    figures.append(
        f"llmvisor's decode p90 is {pct(sharing['shared']['llmvisor']['decode']['rel_err_p90'])} on steps that share context and "
        f"{pct(sharing['unique']['llmvisor']['decode']['rel_err_p90'])} on the others; token_count's "
        f"{pct(sharing['shared']['token_count']['decode']['rel_err_p90'])} and {pct(sharing['unique']['token_count']['decode']['rel_err_p90'])}"
    )
    return figures


def bench_figures(bench: dict) -> list[str]:
    return [
        f"{bench['attribute_step_us']['64']:.2f} µs per step at B=64",
        f"decode-only steps {bench['attribute_step_us_decode_only']['64']:.2f} µs",
        f"with a prefill chunk {bench['attribute_step_us_with_prefill']['64']:.1f} µs",
        f"{thousands(bench['speedup_vs_random_forest']['64'])}× faster than a random forest",
        f"{bench['offline_slices_per_s'] / 1e6:.0f} M slices/s",
        f"fit on 100k steps ({bench['fit_n_slices'] / 1e6:.1f} M slices) with the boundary search in {bench['fit_100k_steps_s']:.2f} s",
    ]


def validation_floor_clause(validation: dict) -> str:
    """The README's claim on the exact batches' errors against the re-measurement floor, with its interval: "within"
    only where every quoted p90 is inside the floor's p90 interval, and which batch sizes the floor was measured on."""
    summary = validation["summary"]
    floor = summary["noise_floor"]["shapley"]
    ours = {phase: summary["errors"][phase]["shapley"]["shapley"] for phase in ("prefill", "decode")}
    within = all(ours[phase]["p90"] <= floor[phase]["p90_ci95"][1] for phase in ours)
    sizes = sorted({b["size"] for b in validation["batches"] if "shapley_replicate_s" in b})
    return (f"{'within' if within else 'above'} the re-measurement noise floor's 95% interval (p90 {with_ci(floor['prefill'], 'p90')} "
            f"prefill, {with_ci(floor['decode'], 'p90')} decode; {floor['prefill']['n_batches']} and {floor['decode']['n_batches']} "
            f"batches measured twice, all of {' and '.join(map(str, sizes))} requests, so the floor of larger batches is not measured)")


def validation_figures(validation: dict) -> list[str]:
    summary = validation["summary"]
    errors = summary["errors"]
    ours = {phase: errors[phase]["shapley"]["shapley"] for phase in ("prefill", "decode")}
    tokens = {phase: errors[phase]["shapley"]["token_count"] for phase in ("prefill", "decode")}
    gain = summary["improvement_vs_token_count"]["decode"]["shapley"]
    per_request, bias = summary["per_request_error"], summary["class_bias"]
    return [
        f"{summary['n_batches']['prefill'] + summary['n_batches']['decode']} batches of 2–5 requests",
        f"{thousands(validation['settings']['measurement_runs'][0]['measured_steps'])}\ncontrolled steps",
        f"within {pct(ours['prefill']['p50'])} / {pct(ours['prefill']['p90'])} (prefill) and "
        f"{pct(ours['decode']['p50'])} / {pct(ours['decode']['p90'])} (decode)",
        validation_floor_clause(validation),
        f"{pct(tokens['decode']['p90'])} off at p90\nas a fraction of the step ({gain:.1f}× worse)",
        f"as good ({pct(tokens['prefill']['p90'])} at p90)",
        f"miss {100 * -summary['loo_sum_gap_fraction']['decode']['p50']:.0f}% of a decode step at the median",
        f"{pct(per_request['prefill']['shapley']['p50'])} / {pct(per_request['prefill']['shapley']['p90'])} (prefill) and "
        f"{pct(per_request['decode']['shapley']['p50'])} / {pct(per_request['decode']['shapley']['p90'])} (decode) at p50 / p90. On decode",
        f"{pct(per_request['decode']['token_count']['p90'])} off a request's own Shapley value at p90",
        f"quarter of decodes {signed_pct(bias['decode/length_q1']['token_count']['bias'])} and the longest "
        f"{signed_pct(bias['decode/length_q4']['token_count']['bias'])} in aggregate (`shapley`: "
        f"{signed_pct(bias['decode/length_q1']['shapley']['bias'])} and {signed_pct(bias['decode/length_q4']['shapley']['bias'])})",
        f"({sum(s['n_batches'] for s in summary['sampled'].values())} batches of "
        f"{' and '.join(map(str, sorted({size for s in summary['sampled'].values() for size in s['sizes']})))} requests",
        f"{thousands(validation['settings']['measurement_runs'][-1]['measured_steps'])} controlled steps), their Shapley values estimated from "
        f"{validation['settings']['sampled']['orders']} sampled",
        f"token shares bill the shortest-context quarter of decodes {signed_pct(bias['sampled_decode/length_q1']['token_count']['bias'])} and the\n"
        f"longest {signed_pct(bias['sampled_decode/length_q4']['token_count']['bias'])} (`shapley`: {signed_pct(bias['sampled_decode/length_q1']['shapley']['bias'])} "
        f"and {signed_pct(bias['sampled_decode/length_q4']['shapley']['bias'])})",
        f"({pct(summary['sampled']['sampled_decode']['estimate_ci95_half_width_fraction_of_step']['p50'])} of a decode step at the median)",
    ]


def fairness_figures(fairness: dict) -> list[str]:
    summaries = {policy: run["summary"] for policy, run in fairness["policies"].items()}
    attributed = summaries["attributed"]
    free = {policy: run["model_free"] for policy, run in fairness["policies"].items()}
    admission = fairness["admission"]
    return [
        f"max/min {attributed['engine_time_max_min']:.2f}, Jain {attributed['jain']:.3f}",
        f"FCFS gave {summaries['fcfs']['engine_time_max_min']:.2f}× and token VTC\n{summaries['tokens']['engine_time_max_min']:.2f}×",
        f"max/min {free['attributed']['max_min']:.2f} (Jain {free['attributed']['jain']:.3f}) under attributed VTC, "
        f"{free['fcfs']['max_min']:.2f} under FCFS and {free['tokens']['max_min']:.2f} under token VTC",
        f"control (TPOT ≤ {1000 * admission['tpot_slo_s']:.0f} ms) p99 TPOT was {1000 * admission['with']['all']['tpot_s']['p99']:.1f} ms and goodput rose from "
        f"{admission['without']['all']['goodput_tokens_per_s']:.0f} to {admission['with']['all']['goodput_tokens_per_s']:.0f} tokens/s",
    ]


def fleet_figures(fleet: dict) -> list[str]:
    ratio = {name: run["summary"]["engine_time_max_min"] for name, run in fleet["runs"].items()}
    return [f"fleet-wide max/min of {ratio['shared']:.2f} where per-replica counters gave {ratio['local']:.2f} and FCFS {ratio['fcfs']:.2f}"]


def load_figures(load_result: dict) -> list[str]:
    rates = {(t["database"], t["body"]): t["steps_per_s"] for t in load_result["targets"]}
    return [
        f"{thousands(rates[('sqlite', 'parquet')])} steps/s into SQLite and {thousands(rates[('postgresql', 'parquet')])} into PostgreSQL with Parquet bodies",
        f"{thousands(rates[('sqlite', 'columns')])} and {thousands(rates[('postgresql', 'columns')])}\nwith JSON columns",
    ]


def calibration_readme_figures(result: dict) -> list[str]:
    residual = {name: pct(figures["all"]["abs_relative_residual_p50"]) for name, figures in result["residuals"].items()}
    return [
        f"the shipped model is off by {residual['shipped']} at the median; calibrated from live steps, {residual['live']}; "
        f"from a profile, {residual['profile']}:",
        f"within 1.5× of the served engine's noise floor ({pct(result['noise_floor']['p50'])}, identical canary steps",
    ]


def staleness_cell(staleness: dict) -> str:
    return f"{staleness['p50']:.1f} / {staleness['p99']:.1f}" if staleness["n"] else "– / –"


def met(flag: bool) -> str:
    return "met" if flag else "missed"


def scale_figures(scale: dict) -> list[str]:
    aggregate = [run for run in scale["runs"] if run["settings"]["mode"] == "aggregate"]
    steps = [run for run in scale["runs"] if run["settings"]["mode"] == "steps"]
    figures = []
    for run in aggregate:
        latency, staleness, agg, pg = run["ingest_latency_s"], run["staleness_s"], run["aggregate"], run["postgres_per_step"]
        figures.append(
            f"| {thousands(run['settings']['engines'])} | {thousands(run['offered_steps_per_s'])} | "
            f"{thousands(run['steps_covered_per_s'])} | {thousands(agg['accepted_windows_per_s'])} | "
            f"{thousands(agg['steps_uncovered_at_end'])} / {thousands(agg['steps_late'])} | "
            f"{1e3 * latency['p50']:.0f} / {1e3 * latency['p99']:.0f} | {staleness_cell(staleness)} | "
            f"{run['staleness_probes_timed_out']} of {run['staleness_probes_timed_out'] + staleness['n']} | "
            f"{1e6 * run['service_cpu_s_per_step']:.0f} | {pg['wal_bytes']:.0f} + {pg['table_bytes']:.0f} | "
            f"{run['archive_bytes_per_step']:.0f} | {1e6 * agg['engine_cpu_s_per_step']['total']:.0f} | {run['load_average_1min_max']:.1f} |"
        )
    for run in steps:
        latency, staleness = run["ingest_latency_s"], run["staleness_s"]
        figures.append(
            f"| {thousands(run['settings']['engines'])} | {thousands(run['offered_steps_per_s'])} | "
            f"{thousands(run['steps_covered_per_s'])} | {run['mean_steps_per_post']:.0f} | "
            f"{1e3 * latency['p50']:.0f} / {1e3 * latency['p99']:.0f} | {staleness['p50']:.1f} / {staleness['p99']:.1f} | "
            f"{run['staleness_probes_timed_out']} of {run['staleness_probes_timed_out'] + staleness['n']} | "
            f"{1e6 * run['service_cpu_s_per_step']:.0f} | {1e6 * run['postgres_per_step']['cpu_s']:.0f} | "
            f"{run['postgres_per_step']['wal_bytes']:,.0f} + {run['postgres_per_step']['table_bytes']:,.0f} |"
        )
    for name, runs in (("aggregate", aggregate), ("steps", steps)):
        loads = [value for run in runs for value in [*run["load_average_1min"], run.get("load_average_1min_max") or run["load_average_1min"][0]]]
        figures.append(f"{name} runs: between {min(loads):.1f} and {max(loads):.1f} on {scale['machine']['cpus']} cores")
    large = aggregate[-1]
    agg, pg = large["aggregate"], large["postgres_per_step"]
    steps_per_window = large["steps_acknowledged"] / agg["windows_acknowledged"]
    figures += [
        f"{agg['tenants_per_window']:.1f} tenants and {agg['requests_per_window']:.1f} requests per window of "
        f"{steps_per_window:.0f} steps, {agg['finished_requests_per_step']:.2f} finished requests per step",
        f"windows {pg['windows_bytes']:.1f}, tenant_seconds {pg['tenant_seconds_bytes']:.1f}, step_ranges "
        f"{pg['step_ranges_bytes']:.1f} bytes of tables per step, {pg['wal_bytes']:.1f} bytes of WAL",
        f"{1e6 * agg['engine_cpu_s_per_step']['total']:.0f} µs of engine CPU per step "
        f"({1e6 * agg['engine_cpu_s_per_step']['aggregation']:.0f} µs aggregation, {1e6 * agg['engine_cpu_s_per_step']['archive_write']:.0f} µs "
        f"archive write), {pct(scale['per_step']['aggregate']['engine_cpu_share_of_step'])} of a step's time",
        f"built in {agg['build_s']:.0f} s",
    ]
    for run in scale["comparison_runs"]:  # the same fleet, request totals kept
        cpg = run["postgres_per_step"]
        figures.append(
            f"{thousands(run['settings']['engines'])} engines with request totals kept: {thousands(run['steps_covered_per_s'])} steps/s covered, "
            f"{1e6 * run['service_cpu_s_per_step']:.0f} µs of service CPU and {cpg['wal_bytes']:.0f} + {cpg['table_bytes']:.0f} bytes "
            f"per step ({cpg['request_totals_bytes']:.1f} bytes of it request_totals' table)")
    goals = scale["goals"]
    figures += [
        f"Every offered step covered by an accepted window, none late: **{met(goals['every_step_covered_in_time'])}** "
        f"({thousands(goals['steps_uncovered_at_end'])} of {thousands(goals['steps_offered'])} steps uncovered at the end, "
        f"{thousands(goals['steps_late'])} late)",
        f"Staleness p99 ≤ {goals['staleness_goal_s']:.0f} s: **{met(goals['staleness_met'])}** ("
        + (f"{goals['staleness_p99_s']:.1f} s)" if goals["staleness_p99_s"] is not None else f"no probe was answered within {PROBE_TIMEOUT_S:.0f} s)"),
        f"PostgreSQL WAL + tables ≤ {goals['postgres_goal_bytes_per_step']:.0f} bytes per step: **{met(goals['postgres_met'])}** "
        f"({goals['postgres_bytes_per_step']:.0f} bytes)",
        f"{goals['goal_bytes_per_finished_request']:.0f} bytes per finished request",
        f"Per-tenant totals equal the archive's re-attribution: **{met(goals['audit_exact'])}**",
    ]
    small, middle = aggregate[0], aggregate[1]
    plan_1000, plan_10000 = scale["extrapolation"]["aggregate"]["1000"], scale["extrapolation"]["aggregate"]["10000"]
    figures += [  # the prose's repeats of table figures
        f"need {1e6 * middle['service_cpu_s_per_step']:.0f} µs of CPU per step there",
        f"accepted {agg['accepted_windows_per_s']:.0f} windows a second of the {thousands(large['settings']['engines'])} offered",
        f"{thousands(large['offered_steps_per_s'])} steps a second at {1e6 * large['service_cpu_s_per_step']:.0f} µs of service CPU per step "
        f"is {large['offered_steps_per_s'] * large['service_cpu_s_per_step']:.1f} cores",
        f"The figure at {small['settings']['engines']} engines ({1e6 * small['service_cpu_s_per_step']:.0f} µs)",
        f"against per-step delivery's {steps[-1]['postgres_per_step']['wal_bytes']:,.0f} + {steps[-1]['postgres_per_step']['table_bytes']:,.0f} bytes",
        f"({plan_1000['archive_gb_per_day']:,.0f} GB a day at 1,000 replicas, {plan_10000['archive_gb_per_day']:,.0f} at 10,000",
        f"({plan_1000['service_cores_large_fleet']:.0f} cores, {plan_1000['service_processes_large_fleet']} processes)",
        f"{plan_10000['service_processes_large_fleet']} to {plan_10000['service_processes_small_fleet']} processes",
        f"for the CPU ({plan_1000['postgres_cores']:.1f} cores)",
        f"covers the CPU ({plan_10000['postgres_cores']:.1f} cores) and the WAL ({plan_10000['wal_mb_per_s']:.1f} MB/s)",
        f"table growth ({plan_1000['tables_gb_per_day']:,.0f} GB a day",
    ]
    audit = scale["audit"]
    for t in audit["tenants"]:
        figures.append(f"| {t['tenant']} | {thousands(t['audited_steps'])} | {thousands(t['windows_checked'])} | "
                       f"{t['reattributed_ns'] / 1e9:.6f} | {t['usage_ns'] / 1e9:.6f} | {t['difference_ns']} | {'yes' if t['ok'] else 'no'} |")
    figures.append(f"over {audit['period_s'][1] - audit['period_s'][0]:.0f} s of the {thousands(audit['engines'])}-engine run")
    for mode, plans in scale["extrapolation"].items():
        for replicas, plan in plans.items():
            archive = f"{plan['archive_gb_per_day']:,.0f}" if "archive_gb_per_day" in plan else "–"
            figures.append(
                f"| {mode} | {thousands(int(replicas))} | {thousands(plan['steps_per_s'])} | "
                f"{plan['service_cores_small_fleet']:.0f} ({plan['service_processes_small_fleet']}) | "
                f"{plan['service_cores_large_fleet']:.0f} ({plan['service_processes_large_fleet']}) | "
                f"{plan['postgres_cores']:.1f} ({plan['postgres_servers']}) | {plan['wal_mb_per_s']:.1f} | "
                f"{plan['tables_gb_per_day']:,.0f} | {archive} |"
            )
    return figures


def minus(text: str) -> str:
    """The doc's prose writes negative figures with a minus sign (−), not a hyphen."""
    return text.replace("-", "−")


def whole_pct(value: float, signed: bool = False) -> str:
    return minus(f"{100 * value:+.0f}%") if signed else f"{100 * value:.0f}%"


def signed_pct1(value: float) -> str:
    return minus(f"{100 * value:+.1f}%")


def validation_doc_figures(validation: dict) -> list[str]:
    """The figures docs/validation.md's prose quotes from the shipped result (the generated tables are tied by
    markdown_summary): each as the doc prints it."""
    summary, settings = validation["summary"], validation["settings"]
    shapley = {p: summary["errors"][p]["shapley"] for p in ("prefill", "decode")}
    ours = {p: shapley[p]["shapley"] for p in shapley}
    tokens = {p: shapley[p]["token_count"] for p in shapley}
    additive = {p: shapley[p]["measured_additive_fit"] for p in shapley}
    gain = {p: summary["improvement_vs_token_count"][p]["shapley"] for p in shapley}
    floor = summary["noise_floor"]["shapley"]
    loo = summary["loo_sum_gap_fraction"]
    shared_cost = {p: summary["additivity"][p]["intercept_fraction_of_step"]["p50"] for p in shapley}
    per_request, bias = summary["per_request_error"], summary["class_bias"]
    decode_terms = summary["interactions"]["decode"]["terms"]
    pairs = decode_terms["pairs"]
    goal = summary["goal_met"]
    exact = validation["batches"]
    decode_batches = [b for b in exact if b["phase"] == "decode"]
    prefill_batches = [b for b in exact if b["phase"] == "prefill"]
    drift = [b["context_drift_tokens"] for b in decode_batches]
    contexts = [c for b in decode_batches for c in b["nominal_context_tokens"]]
    prefill_tokens = [sum(b["num_new_tokens"]) for b in prefill_batches]
    sizes = [sum(1 for b in prefill_batches if b["size"] == n) for n in sorted({b["size"] for b in exact})]
    run, sampled_run = settings["measurement_runs"][0], settings["measurement_runs"][-1]
    factors = settings["length_rules"]["scale_factors"]
    model_err = summary["additivity"]["decode"]["model_subset_rel_err"]
    exact_classes = {k: v["shapley"]["bias"] for k, v in bias.items() if not k.startswith("sampled_") and "/" in k}
    largest = max(exact_classes, key=lambda k: abs(exact_classes[k]))
    sampled = summary["sampled"]
    agree = summary["sampler_agreement"]
    sampled_errors = {k: v["errors"] for k, v in sampled.items()}
    half_width = {k: v["estimate_ci95_half_width_fraction_of_step"]["p50"] for k, v in sampled.items()}
    sampled_classes = {k: v["shapley"] for k, v in bias.items() if k.startswith("sampled_") and "/" in k and not k.startswith("sampled_mixed")}

    def step_pair(kind: str, method: str) -> str:
        e = sampled_errors[kind][method]
        return f"{pct(e['p50'])} / {pct(e['p90'])}"

    figures = [
        f"its error is p50 {pct(ours['decode']['p50'])} / p90 {pct(ours['decode']['p90'])} / p99 {pct(ours['decode']['p99'])} of the step, "
        f"{gain['decode']:.1f}× better than `token_count` shares (VTC's token prices) at p90 and "
        f"{shapley['decode']['proportional']['p90'] / ours['decode']['p90']:.1f}× better than the `proportional` rule",
        f"prefill steps p50 {pct(ours['prefill']['p50'])} / p90 {pct(ours['prefill']['p90'])} / p99 {pct(ours['prefill']['p99'])}, "
        f"tied with `token_count` shares (p90 {pct(tokens['prefill']['p90'])}, p99 {pct(tokens['prefill']['p99'])};",
        f"decode — met on all three ({pct(ours['decode']['p50'])}, {pct(ours['decode']['p90'])}, {gain['decode']:.2f}×). "
        f"Prefill — median and p90 met ({pct(ours['prefill']['p50'])}, {pct(ours['prefill']['p90'])}); the 2× criterion is "
        f"**not met ({gain['prefill']:.2f}×)**"
        if all(goal["decode"].values()) and goal["prefill"] == {"median": True, "p90": True, "vs_token_count": False}
        else "the Goal bullet's verdicts, rewritten to summary.goal_met",
        f"(the shared cost is {pct(shared_cost['prefill'])} of a prefill step at the median)",
        f"(`token_count` p90 {pct(tokens['prefill']['p90'])} vs a noise floor of p90 {pct(floor['prefill']['p90'])})",
        f"only measured to within ~{pct(floor['prefill']['p90'])} (p90)",
        f"reproduces the measured Shapley values to p90 {pct(additive['prefill']['p90'])} (prefill) and {pct(additive['decode']['p90'])} (decode)",
        minus(f"(padding term t = {decode_terms['size_x_max_tokens']['t']:.1f}: no padding cost on this engine)"),
        f"falls short of T(B) by {whole_pct(-loo['decode']['p50'])} at the median (between {whole_pct(-loo['decode']['p90'])} and "
        f"{whole_pct(-loo['decode']['p10'])} for 80% of batches)",
        f"On prefill steps the gap is {whole_pct(-loo['prefill']['p50'])} (median)",
        f"reported ({per_request['prefill']['shapley']['n_below_floor']} prefill requests, "
        + ("no decode request" if per_request["decode"]["shapley"]["n_below_floor"] == 0 else f"{per_request['decode']['shapley']['n_below_floor']} decode requests")
        + ", in the shipped run)",
        f"`shapley`: prefill p50 {pct(per_request['prefill']['shapley']['p50'])} / p90 {pct(per_request['prefill']['shapley']['p90'])}, "
        f"decode p50 {pct(per_request['decode']['shapley']['p50'])} / p90 {pct(per_request['decode']['shapley']['p90'])}.",
        f"`token_count`: prefill {pct(per_request['prefill']['token_count']['p50'])} / {pct(per_request['prefill']['token_count']['p90'])}, "
        f"decode {pct(per_request['decode']['token_count']['p50'])} / {pct(per_request['decode']['token_count']['p90'])}.",
        f"`shapley` is within ±{pct(abs(exact_classes[largest]))} on every class",
        minus(f"{signed_pct(exact_classes[largest])} {signed_ci(bias[largest]['shapley']['ci95'])})"),
        f"`token_count` bills short decode contexts {whole_pct(bias['decode/length_q1']['token_count']['bias'], True)} and long ones "
        f"{whole_pct(bias['decode/length_q4']['token_count']['bias'], True)}, small requests of a decode batch "
        f"{whole_pct(bias['decode/small_in_batch']['token_count']['bias'], True)} and large ones {whole_pct(bias['decode/large_in_batch']['token_count']['bias'], True)}; "
        f"`proportional` does the opposite on decode (large {whole_pct(bias['decode/large_in_batch']['proportional']['bias'], True)}, "
        f"small {whole_pct(bias['decode/small_in_batch']['proportional']['bias'], True)})",
        f"contexts grow by at most {max(drift):.0f} tokens while the batch is measured (median {statistics.median(drift):.0f})",
        f"a 128-token prefill, {1000 * validation['interference']['canary_s']['p50']:.1f} ms at the median",
        f"In the shipped run {run['discarded_batch_rounds']} batch-rounds were discarded this way",
        f"one pair of batches in every 8 ({floor['prefill']['n_batches']} prefill, {floor['decode']['n_batches']} decode)",
        f"{settings['batches']} batches, alternating prefill and decode, sizes {settings['min_batch']}–{settings['max_batch']} "
        f"({'/'.join(map(str, sizes))} per phase), {100 * settings['adversarial_fraction']:.0f}% adversarial; K = {settings['repeat']}; "
        f"{thousands(run['measured_steps'])} measured subset steps (plus warm-up, canary and redone steps); {run['wall_s'] / 60:.1f} minutes in all",
        "s = min(1, 3840 / p99(P + O)) per mix (" + ", ".join(f"{v:.2f}" for v in factors["decode"].values()) + f"), so contexts span "
        f"{min(contexts):,}–{max(contexts):,} tokens (median {int(statistics.median(contexts) + 0.5):,})",
        "s = min(1, 1024 / p99(P)) per mix (" + ", ".join(f"{v:.2f}" for v in factors["prefill"].values()) + ")",
        f"Prefill batches hold {min(prefill_tokens):,}–{max(prefill_tokens):,} tokens (median {int(statistics.median(prefill_tokens) + 0.5):,})",
        f"batch steps of {1000 * min(b['measured_step_s'] for b in prefill_batches):.0f}–{1000 * max(b['measured_step_s'] for b in prefill_batches):.0f} ms; "
        f"full-batch decode steps take {1000 * min(b['measured_step_s'] for b in decode_batches):.1f}–{1000 * max(b['measured_step_s'] for b in decode_batches):.0f} ms",
        f"the run to {run['wall_s'] / 60:.1f} minutes",
        f"decode errors double (p90 {pct(shapley['decode']['shapley_predicted']['p90'])}) because the model prices decode steps of this "
        f"validation {pct(model_err['p50'])} (p50) / {whole_pct(model_err['p90'])} (p90) off",
        f"(p90 {pct(shapley['decode']['proportional']['p90'])}, and {whole_pct(shapley['decode']['proportional']['p99'])} at p99): it hands the shared cost "
        f"({whole_pct(shared_cost['decode'])} of a decode step at the median)",
        f"(p90 {pct(tokens['decode']['p90'])}, adversarial p90 {pct(summary['errors_by_kind']['decode']['adversarial']['token_count']['p90'])})",
        minus(f"(the `pairs` term: {1000 * pairs['coef']:.3f} ms per pair of requests, t = {pairs['t']:.1f}), explaining "
              f"{pct(pairs['explained_fraction_of_additive_residual'])} of an additive residual"),
        f"(`shapley` p90 {pct(ours['decode']['p90'])} vs `measured_additive_fit` {pct(additive['decode']['p90'])}) is within the decode noise floor "
        f"(p90 {pct(floor['decode']['p90'])})",
        f"the measured shared cost of a prefill step ({pct(shared_cost['prefill'])} median)",
        f"The shipped result adds {settings['sampled']['batches']} serving-size batches",
        f"{' and '.join(map(str, settings['sampled']['sizes']))} requests, {settings['sampled']['orders']} orders "
        f"({settings['sampled']['orders'] // 2} antithetic pairs) each, every prefix measured once: {thousands(sampled_run['measured_steps'])} controlled steps "
        f"in {sampled_run['wall_s'] / 60:.0f} minutes on the quiet machine (the model's budget said {settings['sampled']['model_budget_s'] / 60:.0f} + "
        f"{settings['sampled']['model_preparation_s'] / 60:.0f}), {sampled_run['discarded_batch_rounds']} batch-rounds discarded",
        f"on the {agree['n_batches']} exact batches, {agree['n_orders']} orders drawn from their own measured subsets land within "
        f"{pct(agree['abs_error_fraction_of_step']['p50'])} (p50) / {pct(agree['abs_error_fraction_of_step']['p90'])} (p90) of the step of the exact "
        f"Shapley value; its 95% intervals hold the exact value for {whole_pct(agree['ci95_coverage'])} of requests (t-intervals from "
        f"{agree['n_orders'] // 2} pairs under-cover)",
        f"on decode (p50 / p90 {step_pair('sampled_decode', 'shapley')} vs {step_pair('sampled_decode', 'token_count')}) and shared-prefix decode "
        f"({step_pair('sampled_shared_prefix_decode', 'shapley')} vs {step_pair('sampled_shared_prefix_decode', 'token_count')}) batches",
        f"mixed ({step_pair('sampled_mixed', 'shapley')} vs {step_pair('sampled_mixed', 'token_count')}) batches",
        f"(p50 {pct(half_width['sampled_decode'])} of the step for decode, {pct(half_width['sampled_prefill'])} prefill, "
        f"{pct(half_width['sampled_mixed'])} mixed, {pct(half_width['sampled_shared_prefix_decode'])} shared-prefix)",
        f"`shapley` p90 {whole_pct(per_request['sampled_decode']['shapley']['p90'])} (decode), "
        f"{whole_pct(per_request['sampled_shared_prefix_decode']['shapley']['p90'])} (shared-prefix), "
        f"{whole_pct(per_request['sampled_prefill']['shapley']['p90'])} (prefill), against token shares' "
        f"{whole_pct(per_request['sampled_decode']['token_count']['p90'])}, {whole_pct(per_request['sampled_shared_prefix_decode']['token_count']['p90'])}, "
        f"{whole_pct(per_request['sampled_prefill']['token_count']['p90'])}",
        f"so {per_request['sampled_mixed']['shapley']['n_below_floor']} of {sampled['sampled_mixed']['n_requests']} requests (the decodes) fall below the 2% floor",
        f"serving-size decodes {whole_pct(bias['sampled_decode/length_q1']['token_count']['bias'], True)} and the longest "
        f"{whole_pct(bias['sampled_decode/length_q4']['token_count']['bias'], True)} (shared-prefix batches: "
        f"{whole_pct(bias['sampled_shared_prefix_decode/length_q1']['token_count']['bias'], True)} and "
        f"{whole_pct(bias['sampled_shared_prefix_decode/length_q4']['token_count']['bias'], True)})",
        f"lie between {signed_pct1(min(c['bias'] for c in sampled_classes.values()))} and {signed_pct1(max(c['bias'] for c in sampled_classes.values()))} outside mixed batches",
        f"(decode q4 {signed_pct1(bias['sampled_decode/length_q4']['shapley']['bias'])} {minus(signed_ci(bias['sampled_decode/length_q4']['shapley']['ci95']))}, "
        f"shared-prefix q4 {signed_pct1(bias['sampled_shared_prefix_decode/length_q4']['shapley']['bias'])} "
        f"{minus(signed_ci(bias['sampled_shared_prefix_decode/length_q4']['shapley']['ci95']))})",
        f"as close as on unique decodes (p90 {pct(sampled_errors['sampled_shared_prefix_decode']['shapley']['p90'])} vs "
        f"{pct(sampled_errors['sampled_decode']['shapley']['p90'])} of the step)",
        f"longest-context quartile is {signed_pct1(bias['sampled_shared_prefix_decode/length_q4']['shapley']['bias'])} where token shares' is "
        f"{whole_pct(bias['sampled_shared_prefix_decode/length_q4']['token_count']['bias'], True)}",
        f"bringing it from {pct(half_width['sampled_decode'])} to 0.5%",
    ]
    return figures


def missing_from(text: str, figures: list[str]) -> list[str]:
    flat = " ".join(text.split())
    return [figure for figure in figures if " ".join(figure.split()) not in flat]


def test_readme_quotes_each_result_file():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    figures = [
        *demo_figures(load(RESULTS / "demo.json")),
        *bench_figures(load(RESULTS / "bench.json")),
        *load_figures(load(RESULTS / "load.json")),
        *validation_figures(load(shipped.result_path(shipped.VALIDATION_RESULT))),
        *fairness_figures(load(shipped.result_path(shipped.FAIRNESS_RESULT))),
        *fleet_figures(load(shipped.result_path(shipped.FLEET_RESULT))),
    ]
    assert missing_from(readme, figures) == []


def test_validation_doc_holds_the_summary_generated_from_the_shipped_result():
    summary = markdown_summary(load(shipped.result_path(shipped.VALIDATION_RESULT)))
    assert missing_from((REPO / "docs" / "validation.md").read_text(encoding="utf-8"), summary.splitlines()) == []


def test_validation_doc_prose_quotes_the_shipped_result():
    """The figures docs/validation.md states in its own words (verdict, bill, measurement, where the model is off,
    serving-size result) come from the shipped validation.json too, not only its generated tables."""
    validation = load(shipped.result_path(shipped.VALIDATION_RESULT))
    assert missing_from((REPO / "docs" / "validation.md").read_text(encoding="utf-8"), validation_doc_figures(validation)) == []


def test_service_doc_quotes_the_load_result():
    assert missing_from((REPO / "docs" / "service.md").read_text(encoding="utf-8"), load_figures(load(RESULTS / "load.json"))) == []


def test_scale_doc_quotes_the_scale_result():
    assert missing_from((REPO / "docs" / "scale.md").read_text(encoding="utf-8"), scale_figures(load(RESULTS / "scale.json"))) == []


def test_scale_doc_quotes_the_current_edge_cost_from_its_files():
    """docs/scale.md's note on the archive's columns path quotes archive.json and edge-windows.json as they are."""
    archive = load(RESULTS / "archive.json")["runs"][1]
    edge = load(RESULTS / "edge-windows.json")["runs"][1]
    assert archive["batch_size"] == edge["batch_size"] == 32 and archive["same_files"]
    doc = " ".join((REPO / "docs" / "scale.md").read_text(encoding="utf-8").split())
    assert (f"at B = 32 its CPU went from {archive['rows_path_cpu_us_per_step']} to {archive['writer_cpu_us_per_step']} µs per step "
            "in one run") in doc
    assert f"is {edge['edge_cpu_us_per_step']} µs per step, {edge['fraction_of_step_time_percent']}% of step time" in doc


def test_scale_extrapolation_is_the_measured_costs_scaled():
    scale = load(RESULTS / "scale.json")
    for mode, plans in scale["extrapolation"].items():
        per_step = scale["per_step"][mode]
        runs = [run for run in scale["runs"] if run["settings"]["mode"] == mode]
        assert per_step["service_cpu_s_large_fleet"] == runs[-1]["service_cpu_s_per_step"]
        assert per_step["wal_bytes"] == runs[-1]["postgres_per_step"]["wal_bytes"]
        for replicas, plan in plans.items():
            steps_per_s = int(replicas) * runs[0]["settings"]["steps_per_s_per_engine"]
            assert plan["steps_per_s"] == steps_per_s
            assert plan["postgres_cores"] == pytest.approx(steps_per_s * per_step["postgres_cpu_s"])
            assert plan["tables_gb_per_day"] == pytest.approx(steps_per_s * per_step["table_bytes"] * 86400 / 1e9)
    assert all(run["reconciled"] for run in scale["runs"])  # the doc says nothing was lost or counted twice


def test_scale_goals_and_audit_follow_the_runs():
    """The goal verdicts docs/scale.md prints are what the 1,000-engine run measured; the audit is of that run."""
    scale = load(RESULTS / "scale.json")
    run = next(r for r in scale["runs"] if r["settings"]["mode"] == "aggregate" and r["settings"]["engines"] == 1000)
    goals, pg = scale["goals"], run["postgres_per_step"]
    # the issue's keys, on every run
    assert all(key in r for r in scale["runs"] for key in ("offered_steps_per_s", "steps_covered_per_s", "archive_bytes_per_step"))
    assert all(key in r["settings"] for r in scale["runs"] for key in ("mode", "engines", "window_s"))
    assert all("p99" in r["staleness_s"] and "wal_bytes" in r["postgres_per_step"] and "table_bytes" in r["postgres_per_step"]
               for r in scale["runs"])
    assert goals["postgres_bytes_per_step"] == pytest.approx(pg["wal_bytes"] + pg["table_bytes"])
    assert goals["postgres_met"] == (goals["postgres_bytes_per_step"] <= 30)
    assert goals["staleness_p99_s"] == run["staleness_s"]["p99"]
    assert goals["staleness_goal_s"] == run["settings"]["window_s"] + 1
    p99_s = run["staleness_s"]["p99"]  # null when no probe was answered
    assert goals["staleness_met"] == (p99_s is not None and p99_s <= goals["staleness_goal_s"] and run["staleness_probes_timed_out"] == 0)
    assert goals["every_step_covered_in_time"] == (run["aggregate"]["steps_uncovered_at_end"] == 0 == run["aggregate"]["steps_late"])
    assert scale["audit"]["engines"] == 1000 and scale["audit"]["tenants"]
    # the doc's words: served in full and on time at 10 and 100 (staleness p99 within window + 1 s); at 1,000 every
    # step covered by the end, most late, no probe timed out; with request totals kept the bytes goal is missed
    small, middle = (next(r for r in scale["runs"] if r["settings"]["mode"] == "aggregate" and r["settings"]["engines"] == n) for n in (10, 100))
    for fleet in (small, middle):
        assert fleet["aggregate"]["steps_uncovered_at_end"] == fleet["aggregate"]["steps_late"] == 0
        assert fleet["staleness_s"]["p99"] <= fleet["settings"]["window_s"] + 1 and fleet["staleness_probes_timed_out"] == 0
    assert run["aggregate"]["steps_uncovered_at_end"] == 0 and run["aggregate"]["steps_late"] > 0.5 * run["aggregate"]["steps_offered"]
    assert run["staleness_probes_timed_out"] == 0
    assert all(not r["settings"]["request_totals"] for r in scale["runs"] if r["settings"]["mode"] == "aggregate")
    # "One primary suffices ... at 1,000 replicas", "One primary still covers ... at 10,000"
    assert scale["extrapolation"]["aggregate"]["1000"]["postgres_servers"] == scale["extrapolation"]["aggregate"]["10000"]["postgres_servers"] == 1
    [kept] = scale["comparison_runs"]
    assert kept["settings"]["request_totals"] and kept["settings"]["engines"] == 1000
    assert kept["postgres_per_step"]["wal_bytes"] + kept["postgres_per_step"]["table_bytes"] > 30
    steps_pg = [r for r in scale["runs"] if r["settings"]["mode"] == "steps"][-1]["postgres_per_step"]
    assert (steps_pg["wal_bytes"] + steps_pg["table_bytes"]) / goals["postgres_bytes_per_step"] > 50  # "more than fifty times less"
    assert goals["audit_exact"] == all(t["ok"] and t["difference_ns"] == 0 and t["audited_steps"] > 0 for t in scale["audit"]["tenants"])


def test_fairness_doc_holds_the_tables_generated_from_the_shipped_experiment():
    summary = fairness_markdown_summary(load(shipped.result_path(shipped.FAIRNESS_RESULT)))
    assert missing_from((REPO / "docs" / "fairness.md").read_text(encoding="utf-8"), summary.splitlines()) == []


def memory_experiment_figures(result: dict) -> list[str]:
    """The figures docs/fairness.md's memory-bound section states in its own words, from fairness-memory.json."""
    policies, goals = result["policies"], result["goals"]
    setup, alone = result["setup"], result["alone"]
    missing = {name: [t for t, ok in data["sharing_incentive"]["met"].items() if not ok] for name, data in policies.items()}
    engine = setup["engine"]
    figures = [
        f"{setup['kv_pool_blocks']} KV blocks of {setup['block_size']} tokens",
        f"max_num_seqs {engine['max_num_seqs']}, {engine['max_num_batched_tokens']}-token steps",
        f"{setup['workload']['tenants'][0]['rate_rps']:g} requests/s each",
        f"lengths × {setup['workload']['tenants'][0]['length_scale']:g}",
        f"max_num_seqs {result['alone_engine']['max_num_seqs']} and {result['alone_engine']['kv_pool_blocks']} KV blocks",
        "DRF met it for every tenant: " + ("yes" if goals["drf_meets_sharing_incentive"] else "no"),
        "goal met: " + ("yes" if goals["met"] else "no"),
    ]
    for name, data in policies.items():
        si = data["sharing_incentive"]
        cells = ", ".join(f"{t} {si['ratio'][t]:.2f}" for t in si["ratio"])
        verdict = "every tenant met it" if not missing[name] else "missed by " + ", ".join(missing[name])
        figures.append(f"{POLICY_LABELS[name]}: {cells} ({verdict})")
        for tenant in missing[name]:  # the same run counted in completions, as the doc says
            figures.append(f"{POLICY_LABELS[name]} {tenant}: {si['completions_per_s'][tenant]:.2f} completions/s against "
                           f"{alone[tenant]['completions_per_s'] / setup['n_tenants']:.2f} alone on 1/{setup['n_tenants']}")
    figures.append("alone backlogged throughout: " + ", ".join(f"{t} {'yes' if a['backlogged_throughout'] else 'no'}" for t, a in alone.items()))
    return figures


def test_fairness_doc_holds_the_memory_experiment_tables_and_verdicts():
    """docs/fairness.md's memory-bound section: the tables `llmvisor experiment fairness-memory` generates from its
    JSON, and the verdicts its prose states; the figure beside them is the one the command drew."""
    result = load(RESULTS / "fairness-memory.json")
    assert result["experiment"] == "fairness-memory"
    doc = (REPO / "docs" / "fairness.md").read_text(encoding="utf-8")
    assert missing_from(doc, memory_markdown_summary(result).splitlines()) == []
    assert missing_from(doc, memory_experiment_figures(result)) == []
    assert "![" in doc and "(fairness-memory.png)" in doc and (REPO / "docs" / "fairness-memory.png").stat().st_size > 10_000
    assert result["goals"] == memory_goals(result["policies"]) | {k: v for k, v in result["goals"].items() if k == "alone_backlogged_throughout"}


def test_recorder_doc_holds_the_summary_generated_from_the_calibration_result():
    result = load(RESULTS / "calibration.json")
    assert result["calibrations"]["profile"]["fingerprint_matches"] is True
    assert all(result["goal"]["met"][name] for name in ("live", "profile"))  # the README and the doc say both met the goal
    assert missing_from((REPO / "docs" / "recorder.md").read_text(encoding="utf-8"), calibration_markdown_summary(result).splitlines()) == []
    assert missing_from((REPO / "README.md").read_text(encoding="utf-8"), calibration_readme_figures(result)) == []


def test_the_quoting_check_catches_a_changed_figure():
    demo = load(RESULTS / "demo.json")
    demo["evaluation"]["models"]["llmvisor"]["decode"]["rel_err_p90"] += 0.01
    assert missing_from((REPO / "README.md").read_text(encoding="utf-8"), demo_figures(demo))


@pytest.mark.parametrize("section", ["evaluation", "model", "attribution"])
def test_shipped_demo_result_is_what_the_demo_computes_now(section, demo_now):
    shipped_demo = load(RESULTS / "demo.json")
    if section == "evaluation":
        for name in MODEL_ROWS:
            for phase in ("prefill", "decode", "all"):
                now, then = demo_now[section]["models"][name][phase], shipped_demo[section]["models"][name][phase]
                if name in LIBRARY_MODELS:  # another scikit-learn release grows another forest: as the README prints them
                    assert readme_cells(now) == readme_cells(then), (name, phase)
                    assert now["n_steps"] == then["n_steps"]
                    continue
                point_estimates = [k for k in then if not k.endswith("_ci95")]
                assert {k: now[k] for k in point_estimates} == pytest.approx({k: then[k] for k in point_estimates}, rel=1e-9, abs=1e-12)
        for phase, gains in shipped_demo[section]["improvement"].items():
            assert demo_now[section]["improvement"][phase] == pytest.approx(gains, rel=1e-9)
    elif section == "model":
        def coefficients(model: dict) -> list[float]:
            return [value for segment in model["segments"] for value in segment["coef_s"].values()]

        assert coefficients(demo_now[section]) == pytest.approx(coefficients(shipped_demo[section]), rel=1e-6, abs=1e-12)
        assert demo_now[section]["boundary_new_tokens"] == shipped_demo[section]["boundary_new_tokens"]
        assert {k: demo_now[section]["fit_info"][k] for k in ("n_steps_total", "n_steps_used", "n_warmup_dropped", "n_outliers_dropped")} == {
            k: shipped_demo[section]["fit_info"][k] for k in ("n_steps_total", "n_steps_used", "n_warmup_dropped", "n_outliers_dropped")
        }
    else:
        for rule, by_tenant in shipped_demo[section]["by_rule"].items():
            assert demo_now[section]["by_rule"][rule] == pytest.approx(by_tenant, rel=1e-9)


@pytest.fixture(scope="module")
def demo_now(tmp_path_factory):
    completed = subprocess.run(
        [sys.executable, "-m", "llmvisor.cli", "demo", "-o", str(tmp_path_factory.mktemp("demo")), "--json", "--bootstrap", "20"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def test_traces_readme_describes_each_shipped_trace_from_its_own_file():
    from llmvisor.core.trace import read_trace

    readme = (shipped.data_dir() / "traces" / "README.md").read_text(encoding="utf-8")
    figures = []
    for path in sorted((shipped.data_dir() / "traces").glob("*.parquet")):
        trace = read_trace(path)
        figures.append(f"| `{path.name}` | `{trace.run_ids[0]}` |")
        figures.append(f"| {trace.n_steps:,} | {trace.n_slices:,} |")
    floor = read_trace(shipped.trace_path(shipped.TRAIN_TRACE)).metadata["noise_floor"]
    figures.append(f"p50 {pct(floor['p50'])}, p90 {pct(floor['p90'])}, p99 {pct(floor['p99'])}")
    assert missing_from(readme, figures) == []


def test_fleet_doc_holds_the_tables_generated_from_the_shipped_experiment():
    summary = fleet_markdown_summary(load(shipped.result_path(shipped.FLEET_RESULT)))
    assert missing_from((REPO / "docs" / "fleet.md").read_text(encoding="utf-8"), summary.splitlines()) == []


def test_forest_figures_compare_at_the_precision_the_readme_prints():
    """A forest grown by another scikit-learn release moves its figures in far decimals: still the README's row; a
    move the README would show is not."""
    decode = load(RESULTS / "demo.json")["evaluation"]["models"]["random_forest"]["decode"]
    assert readme_cells({**decode, "rel_err_p90": decode["rel_err_p90"] * (1 + 1e-7)}) == readme_cells(decode)
    assert readme_cells({**decode, "rel_err_p90": decode["rel_err_p90"] + 0.002}) != readme_cells(decode)


# ---------------------------------------------------------------------------------------------------------
# The facts behind the words: a sentence may not say what the shipped files contradict.

def shipped_docs() -> dict[str, str]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), shipped.data_dir() / "traces" / "README.md"]
    return {path.name if path.parent != shipped.data_dir() / "traces" else "traces/README.md": path.read_text(encoding="utf-8") for path in paths}


NO_BOUNDARY = re.compile(r"\b(?:has |with )?no (?:segment )?boundary\b", re.IGNORECASE)
ALL_UNIQUE = re.compile(r"(?:every|each|all) (?:the )?(?:shipped )?contexts?\b[^.;]{0,40}?\b(?:is|are) (?:all )?unique"
                        r"|contexts? (?:are|is) all unique", re.IGNORECASE)
AT_THE_FLOOR = re.compile(r"\bat the (?:re-measurement )?noise floor\b", re.IGNORECASE)
AT_INTERFERENCE = re.compile(r"at the level of interference", re.IGNORECASE)


def contradicted_sentences(text: str, facts: dict) -> list[str]:
    """Phrases of ``text`` the facts contradict: "no boundary" when the shipped model has one; "contexts are unique"
    when shipped measurements share context; "at the noise floor" without the floor's interval beside it; p99 errors
    "at the level of interference" when some model's p99 interval lies above the floor's p99 interval."""
    flat = " ".join(text.split())
    found = []
    if facts["boundary"] is not None:
        found += [m.group(0) for m in NO_BOUNDARY.finditer(flat)]
    if facts["shared_context"]:
        found += [m.group(0) for m in ALL_UNIQUE.finditer(flat) if "exact batches" not in flat[m.start(): m.end() + 20]]
    found += [m.group(0) for m in AT_THE_FLOOR.finditer(flat) if not re.search(r"\[\d+\.\d%, \d+\.\d%\]", flat[m.end(): m.end() + 60])]
    if facts["some_p99_above_floor"]:
        found += [m.group(0) for m in AT_INTERFERENCE.finditer(flat)]
    return found


@pytest.fixture(scope="module")
def facts() -> dict:
    from llmvisor.core.trace import read_trace

    model = load(shipped.latency_model_path())
    validation = load(shipped.result_path(shipped.VALIDATION_RESULT))
    evaluation = load(RESULTS / "demo.json")["evaluation"]
    traces_share = any(read_trace(path).has_shared_context_per_step.any() for path in (shipped.data_dir() / "traces").glob("*.parquet"))
    journal_shares = any(key.endswith("/shared_context") and any(v.get("n", 0) for v in by_method.values() if isinstance(v, dict))
                         for key, by_method in validation["summary"]["class_bias"].items())
    floor_high = max(f["interval"]["p99"][1] for f in evaluation["noise_floor"].values() if f)
    p99_above = any(m[phase]["rel_err_p99_ci95"][0] > floor_high for m in evaluation["models"].values() for phase in ("prefill", "decode"))
    return {"boundary": model["boundary_new_tokens"], "shared_context": traces_share or journal_shares, "some_p99_above_floor": p99_above}


def test_the_shipped_facts_are_as_the_checks_assume(facts):
    """The checks below bite: the shipped model has a boundary, shipped steps share context, and some model's p99
    is above the floor (if one of these changes, the sentences it forbids may become true)."""
    assert facts["boundary"] is not None and facts["shared_context"] and facts["some_p99_above_floor"]


def test_no_doc_says_what_the_shipped_files_contradict(facts):
    found = {name: contradicted_sentences(text, facts) for name, text in shipped_docs().items()}
    assert {name: phrases for name, phrases in found.items() if phrases} == {}


def test_model_exact_shapley_agrees_with_shapley_on_every_batch_boundary_straddlers_included():
    """docs/validation.md: `model_exact_shapley` and `shapley` "agree on every shipped batch, those whose subsets lie on
    both sides of the model's segment boundary ... included" — true of the shipped validation.json, and such batches exist."""
    import numpy as np

    validation = load(shipped.result_path(shipped.VALIDATION_RESULT))
    boundary = load(shipped.latency_model_path())["boundary_new_tokens"]
    assert "the two agree on every shipped batch" in " ".join((REPO / "docs" / "validation.md").read_text(encoding="utf-8").split())
    straddling = 0
    for batch in validation["batches"]:
        shares = batch["shares_s"]
        np.testing.assert_allclose(shares["model_exact_shapley"], shares["shapley"], rtol=1e-9, atol=1e-12)
        new = batch["num_new_tokens"]
        straddling += batch["phase"] == "prefill" and min(new) < boundary < sum(new)
    assert straddling > 0


@pytest.mark.parametrize("old_sentence", [
    "identical to `shapley` for this model, which has no segment boundary), and",
    "shipped sweep; no segment boundary; SHA-256 in the result",
    "unique vs shared context — **every context in the shipped journal is unique** (prefix caching was off)",
    "as a fraction of the step's measured time — at the re-measurement noise floor. Per request",
    "1.8% / 6.2% / 19.8% (p50 / p90 / p99): p99 errors of every model sit at the level of interference (steps slowed by",
])
def test_the_checks_catch_the_old_wrong_sentences(facts, old_sentence):
    assert contradicted_sentences(old_sentence, facts)


def test_the_held_out_improvement_is_called_shown_only_where_the_intervals_are_apart():
    evaluation = load(RESULTS / "demo.json")["evaluation"]
    sentence = improvement_sentence(evaluation)
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    ours, theirs = evaluation["models"]["llmvisor"], evaluation["models"]["token_count"]
    shown = {(phase, q): established(ours[phase], theirs[phase], f"rel_err_p{q}") for phase in ("prefill", "decode") for q in (90, 99)}
    assert "on decode llmvisor is better at p90 and p99; on prefill its lower point estimates are not established" in readme
    assert shown == {("decode", 90): True, ("decode", 99): True, ("prefill", 90): False, ("prefill", 99): False}
    assert re.search(r"prefill \d\.\d× at p90 \(\[[^]]*58\.1%\] vs \[35\.5%, 59\.9%\], intervals overlap: not established\)", sentence)
    assert re.search(r"decode \d\.\d× at p90 \([^)]*intervals apart\)", sentence)
    widened = json.loads(json.dumps(evaluation))
    widened["models"]["llmvisor"]["decode"]["rel_err_p90_ci95"][1] = 0.5  # decode's interval now overlaps token_count's
    assert re.search(r"decode \d\.\d× at p90 \(\[[^]]*, 50\.0%\] vs \[46\.8%, 48\.4%\], intervals overlap: not established\)", improvement_sentence(widened))


def test_policy_quotes_no_held_out_signed_error_but_the_shipped_one():
    """fairness/policy.py once quoted held-out signed errors (−1.2% / −2.4%) that the shipped evaluation no longer
    gives; any signed-error percentage it quotes must be one of the shipped llmvisor medians."""
    text = " ".join((REPO / "src" / "llmvisor" / "fairness" / "policy.py").read_text(encoding="utf-8").split())
    shipped_medians = {signed_pct(load(RESULTS / "demo.json")["evaluation"]["models"]["llmvisor"][phase]["signed_err_p50"]) for phase in ("prefill", "decode")}
    quoted = re.findall(r"signed error[^.]{0,60}?([-+−]?\d+\.\d%)", text)
    assert set(quoted) <= shipped_medians, quoted
    assert not set(re.findall(r"signed error[^.]{0,60}?([-+−]?\d+\.\d%)", "the held-out median signed error is -1.2% for decode")) <= shipped_medians


def test_the_test_runs_floor_comes_only_from_compositions_repeated_across_runs():
    """The README says the test runs repeat a composition only across runs (so their floor includes run-to-run drift)."""
    from collections import defaultdict

    from llmvisor.core.trace import read_traces
    from llmvisor.profile.stats import composition_keys

    tests_ = read_traces(sorted(p for p in (shipped.data_dir() / "traces").glob("*.parquet") if p.name != shipped.TRAIN_TRACE))
    runs, steady = tests_.run_id_per_step, ~tests_.is_warmup_per_step
    groups: dict = defaultdict(set)
    counts: dict = defaultdict(int)
    for k, key in enumerate(composition_keys(tests_)):
        if steady[k]:
            groups[key].add(runs[k])
            counts[key] += 1
    repeated = [key for key, n in counts.items() if n > 1]
    assert repeated and all(len(groups[key]) > 1 for key in repeated)
    assert "The test runs repeat a step composition only across runs" in " ".join((REPO / "README.md").read_text(encoding="utf-8").split())


def admission_factor_figures() -> list[str]:
    """docs/fairness.md's figures on SLO admission's prediction factor, recomputed from the shipped latency model on
    the shipped held-out traces (the model the fairness experiment admits with)."""
    import numpy as np

    from llmvisor.core.model import StepLatencyModel
    from llmvisor.core.trace import read_traces

    model = StepLatencyModel.from_json(shipped.latency_model_path())
    held_out = read_traces(sorted(p for p in (shipped.data_dir() / "traces").glob("*.parquet") if p.name != shipped.TRAIN_TRACE))
    factor = 1 / (1 - model.fit_info_["train_rel_err_p90"])
    predicted, measured = model.predict(held_out), held_out.step_latency_s_per_step
    steady, prefill = ~held_out.is_warmup_per_step, held_out.is_prefill_per_step
    masks = {"decode": steady & ~prefill, "prefill": steady & prefill}
    signed = {k: signed_pct(np.median((predicted[m] - measured[m]) / measured[m])) for k, m in masks.items()}
    covered = {k: f"{100 * np.mean(measured[m] <= factor * predicted[m]):.0f}%" for k, m in masks.items()}
    held_out_factor = np.percentile(measured[masks["decode"]] / predicted[masks["decode"]], 90)
    return [
        f"held-out median signed error on the shipped traces: {signed['decode']} for decode, {signed['prefill']} for prefill steps",
        f"({factor:.3f} for the shipped model)",
        f"it covers {covered['decode']} of decode and {covered['prefill']} of prefill steps",
        f"(`underprediction_factor_p90`: {held_out_factor:.3f} for the shipped model on the shipped traces",
    ]


def test_fairness_doc_quotes_the_admission_factor_of_the_shipped_model():
    assert missing_from((REPO / "docs" / "fairness.md").read_text(encoding="utf-8"), admission_factor_figures()) == []
