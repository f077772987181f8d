"""The fairness experiment's result shown: plots, the report's HTML sections and the Markdown tables docs/fairness.md
quotes (`llmvisor.fairness.experiment` re-exports every name here)."""

from __future__ import annotations

import numpy as np

from llmvisor.fairness.policy import POLICIES, SchedulingPolicy

POLICY_LABELS = {policy.value: policy.label for policy in SchedulingPolicy}


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
