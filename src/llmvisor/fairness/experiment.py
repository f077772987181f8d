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
step trace. Analysis here, identical for every policy: each step's measured time is split by llmvisor's shares
(the charging model, Shapley rule) and summed per tenant over time windows ("attributed engine time"); token
service is VTC's count (prompt tokens computed ×1, output tokens ×2); TTFT and time per output token come from
each request's first and last token times. A tenant is backlogged in a window when it had a request waiting
(arrived, not yet scheduled) at every step of the window; fairness compares backlogged tenants only.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from llmvisor import shipped
from llmvisor.core.attribution import attribute
from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.game import VTC_TOKEN_PRICES
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.stats import quantile_summary
from llmvisor.core.trace import concat_traces, read_trace
from llmvisor.engine_process import run_engine_module
from llmvisor.errors import LlmvisorError
from llmvisor.fairness.policy import POLICIES, SchedulingPolicy, jain_index, max_min_ratio

POLICY_LABELS = {policy.value: policy.label for policy in SchedulingPolicy}
GOAL_MAX_MIN = 1.2
GOAL_JAIN = 0.95
GOAL_THROUGHPUT_LOSS = 0.05


def _percentiles(values: list[float]) -> dict:
    return quantile_summary(values, (50, 99))


def _fairness(values: list[float]) -> tuple[float | None, float | None]:

    if len(values) < 2:
        return None, None
    return max_min_ratio(values), jain_index(values)


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
SLO_RUN = "attributed-slo"
"""Attributed VTC with SLO admission control (``tpot_slo_s``), run beside the policies on the same arrivals."""


def alone_workload(workload: dict, tenant_name: str) -> dict:
    """One tenant's requests alone, arriving at the whole experiment's offered rate (every tenant's rate summed):
    the tenant stays backlogged alone as it was under contention, so its completion rate alone is what the
    engine gives it when it has the engine to itself."""
    tenants = workload["tenants"]
    tenant = next((t for t in tenants if t["name"] == tenant_name), None)
    if tenant is None:
        raise LlmvisorError(f"no tenant {tenant_name!r} in the workload")
    return {**workload, "tenants": [{**tenant, "rate_rps": float(sum(t["rate_rps"] for t in tenants))}]}


# ------------------------------------------------------------------------------------------------ analysis


def analyse_run(result: dict, model, *, window_s: float, warmup_s: float) -> dict:
    """Per-tenant, per-window figures of one policy's run (see the module docstring)."""

    tenants = list(result["tenants"])
    index = {t: k for k, t in enumerate(tenants)}
    n_tenants = len(tenants)
    trace = read_trace(result["trace"])
    trace = trace.select_steps(trace.step_id_per_step >= result["first_step"])
    shares = attribute(model, trace)
    step_start_s = trace.extra["timestamp_s"][trace.step_starts].astype(np.float64) - result["t0_wall_s"]
    slice_t = np.repeat(step_start_s, trace.batch_size_per_step)
    slice_tenant = np.array([index.get(str(t), -1) for t in trace.tenant.tolist()], dtype=np.int64)
    measured = slice_tenant >= 0
    end_s = float(result["end_s"])
    n_windows = max(1, int(math.floor((end_s - warmup_s) / window_s)))
    edges = warmup_s + window_s * np.arange(n_windows + 1)
    slice_window = np.searchsorted(edges, slice_t, side="right") - 1
    in_range = measured & (slice_window >= 0) & (slice_window < n_windows)

    def per_window(weights: np.ndarray) -> np.ndarray:
        flat = slice_window[in_range] * n_tenants + slice_tenant[in_range]
        return np.bincount(flat, weights=weights[in_range], minlength=n_windows * n_tenants).reshape(n_windows, n_tenants)

    attributed = per_window(shares.share_s)
    prompt_tokens = per_window(np.where(trace.is_prefill, trace.num_new_tokens, 0).astype(np.float64))

    step_return = np.asarray(result["step_return_s"], dtype=np.float64)
    step_tokens = np.asarray(result["step_output_tokens"], dtype=np.float64).reshape(-1, n_tenants)
    step_window = np.searchsorted(edges, step_return, side="right") - 1
    ok = (step_window >= 0) & (step_window < n_windows)
    output_tokens = np.zeros((n_windows, n_tenants))
    np.add.at(output_tokens, step_window[ok], step_tokens[ok])
    token_service = VTC_TOKEN_PRICES.cost(prompt_tokens, output_tokens)

    # backlog: a request waits from its submission until the first step that schedules it
    first_scheduled: dict[str, float] = {}
    for request_id, t in zip(trace.request_id.tolist(), slice_t.tolist()):
        external = request_id.rsplit("-", 1)[0]
        if external not in first_scheduled:
            first_scheduled[external] = t
    requests = result["requests"]
    backlogged = np.ones((n_windows, n_tenants), dtype=bool)
    step_window_starts = np.searchsorted(edges, step_start_s, side="right") - 1
    for tenant, k in index.items():
        submitted = np.sort([r["submitted_s"] for r in requests if r["tenant"] == tenant])
        started = np.sort([first_scheduled.get(r["request_id"], math.inf) for r in requests if r["tenant"] == tenant])
        waiting = np.searchsorted(submitted, step_start_s, side="right") - np.searchsorted(started, step_start_s, side="right")
        for w in range(n_windows):
            in_window = step_window_starts == w
            backlogged[w, k] = bool(in_window.any()) and bool((waiting[in_window] > 0).all())

    windows = []
    for w in range(n_windows):
        lo, hi = edges[w], edges[w + 1]
        ttft = {t: [] for t in tenants}
        tpot = {t: [] for t in tenants}
        for r in requests:
            if r["first_token_s"] is not None and lo <= r["first_token_s"] < hi:
                ttft[r["tenant"]].append(r["first_token_s"] - r["arrival_s"])
            if r["finish_s"] is not None and lo <= r["finish_s"] < hi and r["output_tokens"] > 1:
                tpot[r["tenant"]].append((r["finish_s"] - r["first_token_s"]) / (r["output_tokens"] - 1))
        active = [k for k in range(n_tenants) if backlogged[w, k]]
        ratio, jain = _fairness([attributed[w, k] for k in active])
        windows.append(
            {
                "start_s": float(lo),
                "end_s": float(hi),
                "attributed_s": dict(zip(tenants, attributed[w].tolist())),
                "token_service": dict(zip(tenants, token_service[w].tolist())),
                "output_tokens": dict(zip(tenants, output_tokens[w].tolist())),
                "ttft_s": {t: _percentiles(v) for t, v in ttft.items()},
                "tpot_s": {t: _percentiles(v) for t, v in tpot.items()},
                "backlogged": [tenants[k] for k in active],
                "engine_time_max_min": ratio,
                "jain": jain,
                "output_tokens_per_s": float(output_tokens[w].sum() / window_s),
            }
        )

    lo, hi = edges[0], edges[-1]
    always = [k for k in range(n_tenants) if backlogged[:, k].all()]
    totals = attributed.sum(axis=0)
    ratio, jain = _fairness([totals[k] for k in always])
    ttft = {t: [] for t in tenants}
    tpot = {t: [] for t in tenants}
    never_started = dict.fromkeys(tenants, 0)
    for r in requests:
        if r["first_token_s"] is not None and lo <= r["first_token_s"] < hi:
            ttft[r["tenant"]].append(r["first_token_s"] - r["arrival_s"])
        if r["finish_s"] is not None and lo <= r["finish_s"] < hi and r["output_tokens"] > 1:
            tpot[r["tenant"]].append((r["finish_s"] - r["first_token_s"]) / (r["output_tokens"] - 1))
        if r["first_token_s"] is None and r["arrival_s"] < hi:
            never_started[r["tenant"]] += 1
    window_ratios = [w["engine_time_max_min"] for w in windows if w["engine_time_max_min"] is not None]
    window_jains = [w["jain"] for w in windows if w["jain"] is not None]
    finished = {t: sum(1 for r in requests if r["tenant"] == t and r["finish_s"] is not None and lo <= r["finish_s"] < hi) for t in tenants}
    measured_s = float(trace.step_latency_s_per_step[(step_start_s >= lo) & (step_start_s < hi)].sum())
    summary = {
        "interval_s": [float(lo), float(hi)],
        "attributed_s": dict(zip(tenants, totals.tolist())),
        "attributed_fraction": dict(zip(tenants, (totals / max(totals.sum(), 1e-12)).tolist())),
        "backlogged_throughout": [tenants[k] for k in always],
        "engine_time_max_min": ratio,
        "jain": jain,
        "window_engine_time_max_min": {"median": _median(window_ratios), "max": max(window_ratios) if window_ratios else None},
        "window_jain": {"median": _median(window_jains), "min": min(window_jains) if window_jains else None},
        "token_service": dict(zip(tenants, token_service.sum(axis=0).tolist())),
        "output_tokens": dict(zip(tenants, output_tokens.sum(axis=0).tolist())),
        "requests_finished": finished,
        "requests_never_started": never_started,
        "ttft_s": {t: _percentiles(v) for t, v in ttft.items()},
        "tpot_s": {t: _percentiles(v) for t, v in tpot.items()},
        "output_tokens_per_s": float(output_tokens.sum() / (hi - lo)),
        "requests_per_s": float(sum(finished.values()) / (hi - lo)),
        "engine_busy_fraction": measured_s / (hi - lo),
    }
    out = {"summary": summary, "windows": windows, "recorder_overhead": result.get("recorder_overhead")}
    if "scheduler_overhead" in result:
        out["scheduler_overhead"] = result["scheduler_overhead"]
        out["scheduler_state"] = result["scheduler_state"]
    out["run"] = {
        "engine_start_s": result["engine_start_s"],
        "num_arrivals": result["num_arrivals"],
        "waiting_at_end": result["waiting_at_end"],
        "n_steps": int(trace.n_steps),
    }
    return out


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def insitu_check(runs: dict, *, window_s: float, warmup_s: float) -> dict | None:
    """Fairness judged by a second model, fitted on the experiment's own steps (every policy's run).

    The charging model comes from a profiling sweep; this one sees the workload itself (e.g. contexts that
    share cached documents), so a policy that is fair only under the charging model's split shows it here.
    Its own caveat: batch composition varies less than in a sweep, so its coefficients are less certain.
    """

    if len(runs) < 2:
        return None
    traces = []
    for run in runs.values():
        trace = read_trace(run["trace"])
        traces.append(trace.select_steps(trace.step_id_per_step >= run["first_step"]))
    model = StepLatencyModel().fit(concat_traces(traces))
    out = {
        "model_boundary_new_tokens": model.boundary_,
        "model_coef_s": [dict(zip(FEATURE_NAMES, map(float, row))) for row in model.coef_],
        "fit_info": {k: v for k, v in model.fit_info_.items() if isinstance(v, (int, float, str))},
        "policies": {},
    }
    for name, run in runs.items():
        summary = analyse_run(run, model, window_s=window_s, warmup_s=warmup_s)["summary"]
        out["policies"][name] = {
            key: summary[key] for key in ("attributed_s", "engine_time_max_min", "jain", "window_engine_time_max_min", "window_jain")
        }
    return out


def completion_rates(summary: dict) -> dict[str, float]:
    """Requests finished per second in the analysed interval, per tenant."""
    lo, hi = summary["interval_s"]
    return {tenant: n / (hi - lo) for tenant, n in summary["requests_finished"].items()}


def model_free(summary: dict, alone: dict[str, dict]) -> dict:
    """Fairness measured without any latency model: each tenant's completions/s under the policy ÷ its
    completions/s alone on the engine. Fair time-sharing among n backlogged tenants gives each 1/n of the engine,
    so these normalised services are equal; their max/min and Jain index are taken over the tenants backlogged
    throughout the policy's run."""
    rates = completion_rates(summary)
    alone_rates = {tenant: completion_rates(s)[tenant] for tenant, s in alone.items()}
    normalised = {tenant: rates[tenant] / alone_rates[tenant] for tenant in rates if alone_rates.get(tenant)}
    backlogged = [tenant for tenant in summary["backlogged_throughout"] if tenant in normalised]
    ratio, jain = _fairness([normalised[tenant] for tenant in backlogged])
    return {
        "completions_per_s": rates,
        "alone_completions_per_s": alone_rates,
        "normalised_service": normalised,
        "tenants_compared": backlogged,
        "max_min": ratio,
        "jain": jain,
    }


def slo_figures(run: dict, summary: dict, tpot_slo_s: float) -> dict:
    """Per tenant and overall: requests finished in the analysed interval, the share whose time per output token
    met the SLO, TPOT p50/p99, and goodput (output tokens/s of the requests that met it)."""
    lo, hi = summary["interval_s"]
    seconds = hi - lo
    by_tenant: dict[str, list[tuple[float, int]]] = {tenant: [] for tenant in run["tenants"]}
    for r in run["requests"]:
        if r["finish_s"] is not None and lo <= r["finish_s"] < hi and r["output_tokens"] > 1 and r["tenant"] in by_tenant:
            by_tenant[r["tenant"]].append(((r["finish_s"] - r["first_token_s"]) / (r["output_tokens"] - 1), r["output_tokens"]))

    def figures(rows: list[tuple[float, int]]) -> dict:
        tpot = np.array([t for t, _ in rows], dtype=np.float64)
        met = tpot <= tpot_slo_s
        tokens = np.array([n for _, n in rows], dtype=np.float64)
        return {
            "requests": int(tpot.size),
            "met_slo_fraction": float(met.mean()) if tpot.size else None,
            "tpot_s": _percentiles(tpot.tolist()),
            "goodput_tokens_per_s": float(tokens[met].sum() / seconds),
            "output_tokens_per_s": float(tokens.sum() / seconds),
        }

    out = {"tenants": {tenant: figures(rows) for tenant, rows in by_tenant.items()}}
    out["all"] = figures([row for rows in by_tenant.values() for row in rows])
    return out


def admission(without: dict, with_slo: dict, runs: dict[str, dict], tpot_slo_s: float) -> dict:
    """Attributed VTC without and with SLO admission control on the same arrivals: what the SLO buys and costs."""
    state = runs[SLO_RUN].get("scheduler_state") or {}
    waits = state.get("deferral_waits_s") or {}
    still_waiting = state.get("deferred_waiting") or {}
    deferrals = {
        tenant: {
            "requests_deferred": len(waits.get(tenant, [])) + int(still_waiting.get(tenant, 0)),
            "still_deferred_at_end": int(still_waiting.get(tenant, 0)),
            "wait_s": _percentiles(waits.get(tenant, [])),
        }
        for tenant in runs[SLO_RUN]["tenants"]
    }
    result = {
        "tpot_slo_s": tpot_slo_s,
        "without": slo_figures(runs["attributed"], without["summary"], tpot_slo_s),
        "with": slo_figures(runs[SLO_RUN], with_slo["summary"], tpot_slo_s),
        "deferrals": deferrals,
        "deferral_decisions": int(state.get("num_deferred", 0)),
        "tpot_prediction_factor": state.get("tpot_prediction_factor"),
    }
    with_all, without_all = result["with"]["all"], result["without"]["all"]
    p99 = with_all["tpot_s"]["p99"]
    result["goals"] = {
        "p99_tpot_within_slo": None if p99 is None else p99 <= tpot_slo_s,
        "goodput_not_below_without": with_all["goodput_tokens_per_s"] >= without_all["goodput_tokens_per_s"],
    }
    return result


def goals(policies: dict) -> dict:
    """The issue's goals, judged on the figures (None where a policy did not run)."""
    out: dict = {"max_min_goal": GOAL_MAX_MIN, "jain_goal": GOAL_JAIN, "throughput_loss_goal": GOAL_THROUGHPUT_LOSS}
    attributed = policies.get("attributed", {}).get("summary")
    if attributed:
        ratio, jain = attributed["engine_time_max_min"], attributed["jain"]
        # None: fewer than two tenants stayed backlogged, so fairness among backlogged tenants is undefined
        out["attributed_vtc_within_max_min"] = None if ratio is None else ratio <= GOAL_MAX_MIN
        out["attributed_vtc_jain_met"] = None if jain is None else jain >= GOAL_JAIN
        for baseline in ("fcfs", "tokens"):
            other = policies.get(baseline, {}).get("summary")
            if other and other["engine_time_max_min"] is not None and attributed["engine_time_max_min"] is not None:
                out[f"{baseline}_gap_larger"] = other["engine_time_max_min"] > attributed["engine_time_max_min"]
        fcfs = policies.get("fcfs", {}).get("summary")
        if fcfs:
            change = attributed["output_tokens_per_s"] / fcfs["output_tokens_per_s"] - 1
            out["throughput_change_vs_fcfs"] = change
            out["throughput_within_goal"] = change >= -GOAL_THROUGHPUT_LOSS
    return out


def model_free_goals(policies: dict) -> dict:
    """The ground-truth issue's goal on the model-free figures: attributed VTC's max/min of normalised service."""
    out: dict = {"model_free_max_min_goal": GOAL_MAX_MIN}
    for name, data in policies.items():
        figures = data.get("model_free")
        if figures:
            out[f"{name}_model_free_max_min"] = figures["max_min"]
    ratio = out.get("attributed_model_free_max_min")
    out["attributed_model_free_within_max_min"] = None if ratio is None else ratio <= GOAL_MAX_MIN
    return out


# ------------------------------------------------------------------------------------------------ plots


def plot(result: dict):
    """Attributed engine time and token service per tenant per window, one column per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [p for p in POLICIES if p in result["policies"]]
    figure, axes = plt.subplots(3, len(policies), figsize=(4.6 * len(policies), 9.6), squeeze=False, sharey="row")
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"]
    for column, policy in enumerate(policies):
        data = result["policies"][policy]
        windows = data["windows"]
        mid = [(w["start_s"] + w["end_s"]) / 2 for w in windows]
        tenants = list(windows[0]["attributed_s"]) if windows else []
        for k, tenant in enumerate(tenants):
            color = colors[k % len(colors)]
            axes[0, column].plot(mid, [w["attributed_s"][tenant] for w in windows], "-o", ms=3, color=color, label=tenant)
            axes[1, column].plot(mid, [w["token_service"][tenant] / 1000 for w in windows], "-o", ms=3, color=color, label=tenant)
            axes[2, column].plot(mid, [w["ttft_s"][tenant]["p50"] if w["ttft_s"][tenant]["p50"] is not None else np.nan for w in windows], "-o", ms=3, color=color, label=tenant)
        summary = data["summary"]
        ratio = summary["engine_time_max_min"]
        jain = summary["jain"]
        axes[0, column].set_title(
            f"{POLICY_LABELS[policy]}\nengine time max/min {ratio:.2f}, Jain {jain:.3f}" if ratio is not None else POLICY_LABELS[policy], fontsize=10
        )
        axes[2, column].set_xlabel("time since start (s)")
    axes[0, 0].set_ylabel("attributed engine time per window (s)")
    axes[1, 0].set_ylabel("token service per window (k VTC tokens)")
    axes[2, 0].set_ylabel("TTFT p50 (s)")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    figure.legend(handles, labels, loc="upper center", ncol=len(labels) or 1, fontsize=9, frameon=False)
    return figure


def plot_admission(result: dict):
    """Per tenant, without and with SLO admission: share of requests that met the TPOT SLO, and goodput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = result["admission"]
    tenants = [*data["with"]["tenants"], "all"]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x = np.arange(len(tenants))
    for offset, key, label, color in ((-0.2, "without", "attributed VTC", "#1f77b4"), (0.2, "with", f"+ SLO admission ({1000 * data['tpot_slo_s']:.0f} ms)", "#2ca02c")):
        rows = [data[key]["tenants"].get(t) if t != "all" else data[key]["all"] for t in tenants]
        axes[0].bar(x + offset, [100 * (r["met_slo_fraction"] or 0) for r in rows], 0.4, label=label, color=color)
        axes[1].bar(x + offset, [r["goodput_tokens_per_s"] for r in rows], 0.4, label=label, color=color)
    axes[0].set_ylabel("requests meeting the TPOT SLO (%)")
    axes[1].set_ylabel("goodput (output tokens/s of requests meeting it)")
    for axis in axes:
        axis.set_xticks(x, tenants)
        axis.grid(alpha=0.3, axis="y")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.tight_layout(rect=(0, 0, 1, 0.9))
    figure.legend(handles, labels, loc="upper center", ncol=2, fontsize=9, frameon=False)
    return figure


def report_sections(result: dict) -> list[tuple[str, str]]:
    """HTML sections for the llmvisor report: the plot and a summary table per policy."""
    import html

    from llmvisor.plots import figure_png_base64, img_tag

    rows = []
    for policy in POLICIES:
        data = result["policies"].get(policy)
        if not data:
            continue
        summary = data["summary"]
        for k, tenant in enumerate(summary["attributed_s"]):
            cells = [
                POLICY_LABELS[policy] if k == 0 else "",
                tenant,
                f"{summary['attributed_s'][tenant]:.1f}",
                f"{summary['attributed_fraction'][tenant]:.1%}",
                f"{summary['token_service'][tenant]:.0f}",
                f"{summary['requests_finished'][tenant]}",
                format_seconds(summary["ttft_s"][tenant]["p50"]),
                format_seconds(summary["ttft_s"][tenant]["p99"]),
                format_seconds(summary["tpot_s"][tenant]["p50"], 1000),
                format_seconds(summary["tpot_s"][tenant]["p99"], 1000),
                f"{summary['engine_time_max_min']:.2f}" if k == 0 and summary["engine_time_max_min"] is not None else "",
                f"{summary['jain']:.3f}" if k == 0 and summary["jain"] is not None else "",
                f"{summary['output_tokens_per_s']:.1f}" if k == 0 else "",
            ]
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>"
        for h in ("policy", "tenant", "engine s", "share", "token service", "finished", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms", "max/min", "Jain", "output tok/s")
    )
    setup = result["setup"]
    note = (
        f"<p class='note'>{len(setup['workload']['tenants'])} tenants, each {setup['workload']['tenants'][0]['rate_rps']:.2f} requests/s "
        f"of {setup['workload']['tenants'][0]['prompt_tokens']} new prompt + {setup['workload']['tenants'][0]['output_tokens']} output tokens; "
        f"long-context tenants' prompts continue one of {setup['workload']['tenants'][0]['n_conversations']} conversations with a "
        f"{setup['workload']['tenants'][0]['history_tokens']}-token history in the prefix cache. "
        + "".join(
            f"Tenant {tenant['name']}'s prompts continue one of only {tenant['n_conversations']} documents, so its running "
            "requests read the same cached KV blocks. "
            for tenant in setup["workload"]["tenants"]
            if tenant["name"] == "shared"
        )
        + f"Figures over {setup['window_s']:.0f} s windows after {setup['warmup_s']:.0f} s; fairness among tenants backlogged throughout.</p>"
    )
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    sections = [
        ("Fairness: FCFS vs token VTC vs attributed VTC", note + table + _model_free_html(result)),
        ("Fairness over time", img_tag(figure_png_base64(plot(result)), "attributed engine time, token service and TTFT per tenant per window")),
    ]
    if "admission" in result:
        data = result["admission"]
        text = (
            f"<p class='note'>Attributed VTC on the same arrivals, without and with admission control at a TPOT SLO of "
            f"{1000 * data['tpot_slo_s']:.0f} ms: requests finished {data['without']['all']['requests']} vs {data['with']['all']['requests']}; "
            f"meeting the SLO {100 * (data['without']['all']['met_slo_fraction'] or 0):.0f}% vs {100 * (data['with']['all']['met_slo_fraction'] or 0):.0f}%; "
            f"goodput {data['without']['all']['goodput_tokens_per_s']:.0f} vs {data['with']['all']['goodput_tokens_per_s']:.0f} output tokens/s.</p>"
        )
        sections.append(("Admission control against a TPOT SLO", text + img_tag(figure_png_base64(plot_admission(result)), "share meeting the SLO and goodput per tenant")))
    return sections


def _model_free_html(result: dict) -> str:
    import html

    rows = []
    for policy in POLICIES:
        figures = result["policies"].get(policy, {}).get("model_free")
        if not figures:
            continue
        services = ", ".join(f"{t} {v:.2f}" for t, v in figures["normalised_service"].items())
        ratio = "—" if figures["max_min"] is None else f"{figures['max_min']:.2f}"
        jain = "—" if figures["jain"] is None else f"{figures['jain']:.3f}"
        rows.append(f"<tr><td>{html.escape(POLICY_LABELS[policy])}</td><td>{html.escape(services)}</td><td>{ratio}</td><td>{jain}</td></tr>")
    if not rows:
        return ""
    return (
        "<p class='note'>Model-free: each tenant's completions/s under the policy ÷ its completions/s alone on the engine "
        "(fair time-sharing makes them equal).</p><table><thead><tr><th>policy</th><th>normalised service</th>"
        f"<th>max/min</th><th>Jain</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def format_seconds(value, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value * scale:.2f}" if value * scale < 100 else f"{value * scale:.0f}"


# ------------------------------------------------------------------------------------------------ command


def run_policy(spec: dict, log_path: Path) -> dict:
    """One policy in a fresh process; its result dict."""
    out_dir = Path(spec["out_dir"])
    return run_engine_module("llmvisor.engines.vllm.fair_experiment", spec, spec_path=out_dir / "spec.json",
                             result_path=out_dir / "result.json", log_path=log_path, what=f"policy {spec['policy']}: the engine run")


def _load_run(out_dir: Path, name: str) -> dict:
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
            runs[name] = _load_run(out_dir, name)
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
            "hardware": _hardware(),
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


def _hardware() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return "unknown"


# ------------------------------------------------------------------------------------------------ docs


def _ratio(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_summary(result: dict) -> str:
    """The result's tables as Markdown, for docs/fairness.md (a test keeps the doc's copy equal to this)."""
    lines = []
    policies = [p for p in POLICIES if p in result["policies"]]
    tenants = list(result["policies"][policies[0]]["summary"]["attributed_s"])
    lines += [
        f"| policy | engine time {' / '.join(tenants)} (s) | max/min | Jain | per-window max/min (median, worst) | output tok/s | requests/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy in policies:
        s = result["policies"][policy]["summary"]
        windows = s["window_engine_time_max_min"]
        engine_s = " / ".join(f"{s['attributed_s'][t]:.1f}" for t in tenants)
        lines.append(
            f"| {POLICY_LABELS[policy]} | {engine_s} | {_ratio(s['engine_time_max_min'])} | "
            f"{_ratio(s['jain'], 3)} | {_ratio(windows['median'])}, {_ratio(windows['max'])} | {s['output_tokens_per_s']:.0f} | {s['requests_per_s']:.1f} |"
        )
    free = [p for p in policies if result["policies"][p].get("model_free")]
    if free:
        lines += ["", f"| policy | completions/s {' / '.join(tenants)} | ÷ alone: normalised service {' / '.join(tenants)} | max/min | Jain |",
                  "| --- | --- | --- | --- | --- |"]
        for policy in free:
            m = result["policies"][policy]["model_free"]
            rates = " / ".join(f"{m['completions_per_s'][t]:.2f}" for t in tenants)
            lines.append(
                f"| {POLICY_LABELS[policy]} | {rates} | "
                f"{' / '.join(_ratio(m['normalised_service'].get(t)) for t in tenants)} | {_ratio(m['max_min'])} | {_ratio(m['jain'], 3)} |"
            )
        alone = result.get("alone", {})
        lines.append(
            "| alone | " + " / ".join(f"{alone[t]['completions_per_s']:.2f}" if t in alone else "–" for t in tenants) + " | 1 each | | |"
        )
    lines += ["", "| policy | tenant | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | token service (VTC tokens) | finished |", "| --- | --- | --- | --- | --- | --- |"]
    for policy in policies:
        s = result["policies"][policy]["summary"]
        for k, t in enumerate(tenants):
            lines.append(
                f"| {POLICY_LABELS[policy] if k == 0 else ''} | {t} | {format_seconds(s['ttft_s'][t]['p50'])} / {format_seconds(s['ttft_s'][t]['p99'])} | "
                f"{format_seconds(s['tpot_s'][t]['p50'], 1000)} / {format_seconds(s['tpot_s'][t]['p99'], 1000)} | {s['token_service'][t]:,.0f} | {s['requests_finished'][t]} |"
            )
    if "admission" in result:
        data = result["admission"]
        lines += ["", f"| tenant | attributed VTC | finished | met the {1000 * data['tpot_slo_s']:.0f} ms SLO | TPOT p50 / p99 (ms) | goodput (tok/s) | deferred | deferral wait p50 / p99 (s) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for tenant in [*tenants, "all"]:
            for key in ("without", "with"):
                row = data[key]["all"] if tenant == "all" else data[key]["tenants"][tenant]
                deferral = data["deferrals"].get(tenant) if key == "with" else None
                met = "–" if row["met_slo_fraction"] is None else f"{100 * row['met_slo_fraction']:.0f}%"
                lines.append(
                    f"| {tenant if key == 'without' else ''} | {key} SLO admission | {row['requests']} | {met} | "
                    f"{format_seconds(row['tpot_s']['p50'], 1000)} / {format_seconds(row['tpot_s']['p99'], 1000)} | {row['goodput_tokens_per_s']:.0f} | "
                    + ("" if deferral is None else f"{deferral['requests_deferred']}")
                    + " | "
                    + ("" if deferral is None else f"{format_seconds(deferral['wait_s']['p50'])} / {format_seconds(deferral['wait_s']['p99'])}")
                    + " |"
                )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ admission, repeated

ADMISSION_FORMAT = "llmvisor.admission"


def _mean_ci(values: list[float], confidence: float = 0.95) -> dict:
    """Mean over seeds with a Student-t interval (seeds independent: arrivals, prompts and the engine's sampling)."""
    from scipy import stats

    x = np.array([v for v in values if v is not None], dtype=np.float64)
    if x.size == 0:
        return {"n": 0, "mean": None, "ci95": [None, None]}
    mean = float(x.mean())
    if x.size < 2:
        return {"n": 1, "mean": mean, "ci95": [None, None]}
    half = float(stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return {"n": int(x.size), "mean": mean, "ci95": [mean - half, mean + half], "values": x.tolist()}


def admission_over_seeds(per_seed: dict[int, dict]) -> dict:
    """Across seeds: per tenant and overall, the share meeting the SLO and the goodput without and with admission,
    and their change on the same arrivals (with − without), each as a mean with a 95% interval; how many seeds met
    each goal."""
    first = next(iter(per_seed.values()))
    rows = [*first["without"]["tenants"], "all"]

    def pick(run: dict, key: str, row: str, field: str):
        block = run[key]["all"] if row == "all" else run[key]["tenants"][row]
        return block[field]

    out: dict = {"seeds": sorted(per_seed), "rows": {}}
    for row in rows:
        entry = {}
        for field in ("met_slo_fraction", "goodput_tokens_per_s"):
            without = [pick(r, "without", row, field) for r in per_seed.values()]
            with_ = [pick(r, "with", row, field) for r in per_seed.values()]
            change = [None if a is None or b is None else b - a for a, b in zip(without, with_, strict=True)]
            entry[field] = {"without": _mean_ci(without), "with": _mean_ci(with_), "change": _mean_ci(change)}
        entry["tpot_p99_s_with"] = _mean_ci([pick(r, "with", row, "tpot_s")["p99"] for r in per_seed.values()])
        out["rows"][row] = entry
    out["goals_met"] = {goal: sum(bool(r["goals"][goal]) for r in per_seed.values()) for goal in first["goals"]}
    return out


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
                runs[name] = _load_run(out_dir, name)
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
            "engine": engine, "workload": workload, "window_s": window_s, "warmup_s": warmup_s, "hardware": _hardware(),
            "tpot_slo_s": tpot_slo_s, "seeds": list(seeds),
            "tpot_prediction_factor": tpot_prediction_factor, "prediction_factor_source": prediction_factor_source,
            "factor_applied": sorted(f for f in factors if f is not None),
        },
        "per_seed": {str(seed): r for seed, r in per_seed.items()},
        "over_seeds": admission_over_seeds(per_seed),
    }
    (output / "admission.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def admission_markdown_summary(result: dict) -> str:
    """The repeated admission result as docs/fairness.md quotes it (generated from admission.json)."""
    setup, over = result["setup"], result["over_seeds"]

    def pct(entry: dict) -> str:
        lo, hi = entry["ci95"]
        return f"{100 * entry['mean']:.0f}%" + ("" if lo is None else f" [{100 * lo:.0f}%, {100 * hi:.0f}%]")

    def pts(entry: dict) -> str:
        lo, hi = entry["ci95"]
        return f"{100 * entry['mean']:+.0f} pts" + ("" if lo is None else f" [{100 * lo:+.0f}, {100 * hi:+.0f}]")

    def tok(entry: dict, signed: bool = False) -> str:
        lo, hi = entry["ci95"]
        f = "{:+.0f}" if signed else "{:.0f}"
        return f.format(entry["mean"]) + ("" if lo is None else f" [{f.format(lo)}, {f.format(hi)}]")

    n = len(over["seeds"])
    lines = [f"Attributed VTC without and with SLO admission at {1000 * setup['tpot_slo_s']:.0f} ms on the same arrivals, "
             f"{n} seeds ({', '.join(map(str, over['seeds']))}), prediction factor {setup['factor_applied'][0]:.3f} "
             f"({setup['prediction_factor_source']}); mean over seeds [95% t-interval]:", "",
             "| tenant | met the SLO without | with | change | goodput without (tok/s) | with | change | TPOT p99 with (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row, entry in over["rows"].items():
        met, good = entry["met_slo_fraction"], entry["goodput_tokens_per_s"]
        p99 = entry["tpot_p99_s_with"]
        lo, hi = p99["ci95"]
        p99_text = f"{1000 * p99['mean']:.1f}" + ("" if lo is None else f" [{1000 * lo:.1f}, {1000 * hi:.1f}]")
        lines.append(f"| {row} | {pct(met['without'])} | {pct(met['with'])} | {pts(met['change'])} | {tok(good['without'])} | "
                     f"{tok(good['with'])} | {tok(good['change'], True)} | {p99_text} |")
    goals = over["goals_met"]
    lines += ["", f"Goals met: p99 TPOT within the SLO in {goals['p99_tpot_within_slo']} of {n} seeds; goodput not below "
              f"without admission in {goals['goodput_not_below_without']} of {n}."]
    return "\n".join(lines)
