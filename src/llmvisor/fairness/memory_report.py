"""The memory-bound fairness experiment's result shown (`llmvisor.fairness.memory_experiment`): its figure and the
Markdown tables docs/fairness.md quotes (a test keeps the doc's copy equal to `markdown_summary` of the shipped JSON)."""

from __future__ import annotations

import numpy as np

from llmvisor.fairness.experiment_analysis import throughput
from llmvisor.fairness.experiment_report import POLICY_LABELS, format_seconds
from llmvisor.fairness.policy import POLICIES

COLORS = {"hog": "#d62728", "chat": "#1f77b4", "code": "#2ca02c"}


def _policies(result: dict) -> list[str]:
    return [p for p in POLICIES if p in result["policies"]]


def _tenants(result: dict) -> list[str]:
    return list(result["policies"][_policies(result)[0]]["memory"]["dominant_share"])


def plot_memory(result: dict):
    """Top: each tenant's throughput ÷ alone on 1/n of the engine per policy (sharing incentive at 1), and its time
    and memory shares. Bottom: each tenant's share of the KV pool per window, one panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies, tenants = _policies(result), _tenants(result)
    figure = plt.figure(figsize=(4.2 * max(len(policies), 2), 8.4))
    grid = figure.add_gridspec(2, max(len(policies), 2))
    half = max(len(policies), 2) // 2
    ratio_axis = figure.add_subplot(grid[0, :half])
    share_axis = figure.add_subplot(grid[0, half:])
    x = np.arange(len(policies))
    width = 0.8 / max(len(tenants), 1)
    for k, tenant in enumerate(tenants):
        color = COLORS.get(tenant)
        offset = (k - (len(tenants) - 1) / 2) * width
        ratios = [result["policies"][p].get("sharing_incentive", {}).get("ratio", {}).get(tenant, np.nan) for p in policies]
        ratio_axis.bar(x + offset, ratios, width, color=color, label=tenant)
        memory = [result["policies"][p]["memory"]["memory_share"][tenant] for p in policies]
        time_share = [result["policies"][p]["memory"]["time_share"][tenant] for p in policies]
        share_axis.bar(x + offset, memory, width, color=color, label=f"{tenant} KV memory")
        share_axis.bar(x + offset, time_share, width, fill=False, edgecolor="black", hatch="//", linewidth=0.6,
                       label="time share" if k == 0 else None)
    ratio_axis.axhline(1.0, color="black", linestyle="--", linewidth=1)
    n = result["setup"]["n_tenants"]
    ratio_axis.set_ylabel(f"output tokens per engine s ÷ alone on 1/{n} of the engine")
    ratio_axis.set_title("sharing incentive: met at ≥ 1", fontsize=10)
    share_axis.set_ylabel("share of the KV pool × wall time (bars); of engine time (hatched)")
    share_axis.set_title("time and KV memory shares over the measured interval", fontsize=10)
    for axis in (ratio_axis, share_axis):
        axis.set_xticks(x, [POLICY_LABELS[p] for p in policies], fontsize=8)
        axis.grid(alpha=0.3, axis="y")
    ratio_axis.legend(fontsize=8)
    share_axis.legend(fontsize=7, ncol=2)
    first = None
    for column, policy in enumerate(policies):
        axis = figure.add_subplot(grid[1, column], sharey=first)
        first = first or axis
        windows = result["policies"][policy]["memory"]["windows"]
        mid = [(w["start_s"] + w["end_s"]) / 2 for w in windows]
        for tenant in tenants:
            axis.plot(mid, [w["memory_share"][tenant] for w in windows], "-o", ms=3, color=COLORS.get(tenant), label=tenant)
        memory = result["policies"][policy]["memory"]
        axis.set_title(f"{POLICY_LABELS[policy]}: {memory['preemptions_total']} preemptions", fontsize=9)
        axis.set_xlabel("time since start (s)")
        axis.grid(alpha=0.3)
    first.set_ylabel("share of the KV pool per window")
    figure.tight_layout()
    return figure


def _f(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_summary(result: dict) -> str:
    """The result's tables as Markdown, for docs/fairness.md."""
    policies, tenants = _policies(result), _tenants(result)
    n = result["setup"]["n_tenants"]
    lines = [
        f"| policy | tenant | output tok per engine s | ÷ alone on 1/{n} | sharing incentive | wall clock: ÷ alone on 1/{n} | "
        "completions/s | time share | KV memory share | dominant share | preemptions |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy in policies:
        data = result["policies"][policy]
        memory, si = data["memory"], data.get("sharing_incentive")
        for k, tenant in enumerate(tenants):
            rate = throughput(data["summary"])[tenant]
            ratio = None if si is None else si["ratio"].get(tenant)
            wall = None if si is None else si["ratio_wall_clock"].get(tenant)
            met = "–" if si is None else ("met" if si["met"][tenant] else "**not met**")
            completions = data["summary"]["requests_finished"][tenant] / (data["summary"]["interval_s"][1] - data["summary"]["interval_s"][0])
            lines.append(
                f"| {POLICY_LABELS[policy] if k == 0 else ''} | {tenant} | {rate:.1f} | {_f(ratio)} | {met} | {_f(wall)} | {completions:.2f} | "
                f"{memory['time_share'][tenant]:.3f} | {memory['memory_share'][tenant]:.3f} | "
                f"{memory['dominant_share'][tenant]:.3f} ({memory['dominant_resource'][tenant]}) | {memory['preemptions'][tenant]} |"
            )
    alone = result.get("alone")
    if alone:
        lines.append(
            f"| alone on 1/{n} | " + " / ".join(tenants) + " | "
            + " / ".join(f"{alone[t]['on_share_output_tokens_per_s']:.1f}" for t in tenants)
            + " | 1 | | 1 | " + " / ".join(f"{alone[t]['completions_per_s'] / n:.2f}" for t in tenants) + " | | | | "
            + " / ".join(str(alone[t]["memory"]["preemptions"][t]) for t in tenants) + " |"
        )
    hog = "hog" if "hog" in tenants else tenants[0]
    lines += [
        "",
        f"| policy | every tenant ≥ alone on 1/{n} | service max/min | Jain (dominant shares) | dominant max/min | preemptions | "
        f"{hog} latency p50 / p99 (s) | {hog} in engine p50 / p99 (s) | {hog} finished | steps | engine busy |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy in policies:
        data = result["policies"][policy]
        memory, si, summary = data["memory"], data.get("sharing_incentive"), data["summary"]
        verdict = "–" if si is None else ("yes" if si["all_met"] else "no")
        latency, in_engine = memory["latency_s"][hog], memory["in_engine_s"][hog]
        lines.append(
            f"| {POLICY_LABELS[policy]} | {verdict} | {_f(None if si is None else si['service_max_min'])} | "
            f"{_f(memory['dominant_share_jain'], 3)} | {_f(memory['dominant_share_max_min'])} | {memory['preemptions_total']} | "
            f"{format_seconds(latency['p50'])} / {format_seconds(latency['p99'])} | "
            f"{format_seconds(in_engine['p50'])} / {format_seconds(in_engine['p99'])} | {summary['requests_finished'][hog]} | "
            f"{data['run']['n_steps']:,} | {summary['engine_busy_fraction']:.0%} |"
        )
    return "\n".join(lines)
