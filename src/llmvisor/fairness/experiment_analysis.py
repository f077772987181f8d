"""The fairness experiment's analysis, identical for every policy's run (`llmvisor.fairness.experiment` runs them).

Each step's measured time is split by llmvisor's shares (the charging model, Shapley rule) and summed per tenant
over time windows ("attributed engine time"); token service is VTC's count (prompt tokens computed ×1, output
tokens ×2); TTFT and time per output token come from each request's first and last token times. A tenant is
backlogged in a window when it had a request waiting (arrived, not yet scheduled) at every step of the window;
fairness compares backlogged tenants only. Also here: the model-free figures, the SLO admission comparison, the
issue's goals, and the repeated admission experiment's figures over seeds.
"""

from __future__ import annotations

import math

import numpy as np

from llmvisor.core.attribution import attribute
from llmvisor.core.features import FEATURE_NAMES
from llmvisor.core.game import VTC_TOKEN_PRICES
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.stats import quantile_summary
from llmvisor.core.trace import concat_traces, read_trace
from llmvisor.fairness.policy import jain_index, max_min_ratio

GOAL_MAX_MIN = 1.2
GOAL_JAIN = 0.95
GOAL_THROUGHPUT_LOSS = 0.05


def _percentiles(values: list[float]) -> dict:
    return quantile_summary(values, (50, 99))


def _fairness(values: list[float]) -> tuple[float | None, float | None]:

    if len(values) < 2:
        return None, None
    return max_min_ratio(values), jain_index(values)


SLO_RUN = "attributed-slo"
"""Attributed VTC with SLO admission control (``tpot_slo_s``), run beside the policies on the same arrivals."""


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


def wall_throughput(summary: dict) -> dict[str, float]:
    """Output tokens per wall-clock second over the measured interval, per tenant."""
    lo, hi = summary["interval_s"]
    return {tenant: float(n / (hi - lo)) for tenant, n in summary["output_tokens"].items()}


def throughput(summary: dict) -> dict[str, float]:
    """Output tokens per second of engine time (the interval's summed step times), per tenant."""
    lo, hi = summary["interval_s"]
    engine_s = float(summary["engine_busy_fraction"] * (hi - lo))
    return {tenant: float(n / engine_s) if engine_s > 0 else 0.0 for tenant, n in summary["output_tokens"].items()}
