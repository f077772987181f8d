"""A self-contained HTML report (plots embedded as PNG) of an evaluation, attribution and validation."""

from __future__ import annotations

import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from llmvisor.core.features import FEATURE_NAMES  # noqa: E402
from llmvisor.core.trace import StepTrace  # noqa: E402
from llmvisor.evaluation.heldout import relative_errors, steady_steps  # noqa: E402
from llmvisor.plots import figure_png_base64, img_tag  # noqa: E402
from llmvisor.profile.stats import warmup_mask_per_step  # noqa: E402

MODEL_COLORS = {"llmvisor": "#1f77b4", "paper_ols": "#ff7f0e", "token_count": "#d62728", "random_forest": "#2ca02c"}


def predicted_vs_measured(result: dict, test: StepTrace) -> str:
    steady = steady_steps(test)
    measured = test.step_latency_s_per_step
    prefill = test.is_prefill_per_step
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for axis, (phase, mask) in zip(axes, (("prefill", steady & prefill), ("decode", steady & ~prefill))):
        for name in ("token_count", "llmvisor"):
            if name in result["predictions"] and mask.any():
                axis.scatter(measured[mask] * 1e3, result["predictions"][name][mask] * 1e3, s=5, alpha=0.45, label=name, color=MODEL_COLORS[name])
        if mask.any():
            low, high = measured[mask].min() * 1e3, measured[mask].max() * 1e3
            axis.plot([low, high], [low, high], color="black", linewidth=0.8)
            axis.set_xscale("log")
            axis.set_yscale("log")
        axis.set_title(f"{phase} steps (held out)")
        axis.set_xlabel("measured step time (ms)")
        axis.set_ylabel("predicted step time (ms)")
        axis.legend()
    return img_tag(figure_png_base64(figure), "predicted vs measured step time per phase")


def error_cdfs(result: dict, test: StepTrace) -> str:
    steady = steady_steps(test)
    measured = test.step_latency_s_per_step
    prefill = test.is_prefill_per_step
    floor = (result.get("noise_floor") or {}).get("test") or (result.get("noise_floor") or {}).get("train")
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for axis, (phase, mask) in zip(axes, (("prefill", steady & prefill), ("decode", steady & ~prefill))):
        for name, predicted in result["predictions"].items():
            if not mask.any():
                continue
            errors = np.sort(relative_errors(predicted[mask], measured[mask]))
            axis.plot(errors * 100, np.linspace(0, 1, errors.size), label=name, color=MODEL_COLORS.get(name))
        if floor:
            for q, style in (("p50", ":"), ("p90", "--"), ("p99", "-.")):
                axis.axvline(floor[q] * 100, color="gray", linestyle=style, linewidth=1, label=f"noise floor {q}")
        axis.set_xscale("symlog", linthresh=1)
        axis.set_xlim(left=0)
        axis.set_xlabel("|predicted − measured| / measured (%)")
        axis.set_ylabel("fraction of held-out steps")
        axis.set_title(f"error CDF, {phase}")
        axis.legend(fontsize=7)
    return img_tag(figure_png_base64(figure), "relative error CDF per model")


def tenant_bars(by_rule: dict[str, dict[str, float]], title: str) -> str:
    tenants = sorted({t for totals in by_rule.values() for t in totals})
    figure, axis = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(by_rule), 1)
    for k, (rule, totals) in enumerate(by_rule.items()):
        axis.bar(np.arange(len(tenants)) + k * width, [totals.get(t, 0.0) for t in tenants], width, label=rule)
    axis.set_xticks(np.arange(len(tenants)) + width * (len(by_rule) - 1) / 2, tenants)
    axis.set_ylabel("attributed engine time (s)")
    axis.set_title(title)
    axis.legend()
    return img_tag(figure_png_base64(figure), title)


def metrics_table(result: dict) -> str:
    rows = []
    for name, phases in result["models"].items():
        for phase in ("prefill", "decode", "all"):
            m = phases.get(phase, {})
            if not m.get("n_steps"):
                continue
            cells = [name, phase, str(m["n_steps"]), "-" if m.get("r2") is None else f"{m['r2']:.3f}"]
            for q in (50, 90, 99):
                ci = m.get(f"rel_err_p{q}_ci95")
                cells.append(f"{m[f'rel_err_p{q}']:.1%}" + (f" [{ci[0]:.1%}, {ci[1]:.1%}]" if ci else ""))
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("model", "phase", "steps", "R²", "p50", "p90 [95% CI]", "p99 [95% CI]"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


FEATURE_MEANINGS = {
    "intercept": ("per step", "fixed cost of one engine step, whatever it holds (scheduling, launch, sampling set-up)"),
    "prefill_new_tokens": ("per new prompt token", "linear compute of a prompt token (projections, MLP) in a prefill chunk"),
    "prefill_context_tokens": ("per cached context token of a prefilling request", "reading the KV cache already held for a chunked or prefix-cached prompt"),
    "prefill_new_tokens_squared": ("per (new prompt tokens)²", "attention among the chunk's own new tokens"),
    "prefill_new_x_context_tokens": ("per new token × context token", "attention of a prefill chunk over the context cached before it"),
    "prefill_requests": ("per prefilling request", "per-request overhead of a prefill slice (metadata, sampling)"),
    "decode_context_tokens": ("per context token of a decoding request", "reading the request's KV cache for its one new token (memory-bound)"),
    "decode_requests": ("per decoding request", "per-request cost of a decode slice: its token's compute and overhead"),
    "effective_context_tokens": (
        "per distinct context token read in a step",
        "reading KV blocks once per step; a block shared by several requests (prefix caching) is split among its readers",
    ),
}


def format_duration_s(seconds: float) -> str:
    """A duration with a readable unit (s, ms, µs, ns)."""
    magnitude = abs(seconds)
    if magnitude == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if magnitude >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def model_coefficients_table(model_dict: dict) -> str:
    """The fitted coefficients by name, with their unit and what each prices, one column per segment."""
    segments = model_dict["segments"]
    identified = set(model_dict.get("identified_features", FEATURE_NAMES))
    head = "".join(f"<th class='text'>{h}</th>" for h in ("coefficient", "unit", "what it prices")) + "".join(
        f"<th class='number'>value ({html.escape(segment['name'])} steps)</th>" for segment in segments
    )
    rows = []
    for name in FEATURE_NAMES:
        unit, meaning = FEATURE_MEANINGS.get(name, ("", ""))
        values = "".join(f"<td class='number'>{format_duration_s(segment['coef_s'][name])}</td>" for segment in segments)
        flag = "" if name in identified else " (not identified: held at 0)"
        rows.append(f"<tr><td><code>{name}</code></td><td class='text'>{html.escape(unit)}</td><td class='text'>{html.escape(meaning + flag)}</td>{values}</tr>")
    boundary = model_dict.get("boundary_new_tokens")
    split = (
        "one coefficient set for every step (no segment boundary)"
        if boundary is None
        else f"steps with fewer than {boundary:g} new tokens use the first set (memory-bound), the others the second"
    )
    return (
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        f"<p class='note'>A step's predicted time is the intercept plus, for every request in it, its coefficients times "
        f"its counts (prefill and decode slices priced apart); {split}. Fitted by non-negative least squares on relative "
        f"error (params: {html.escape(json.dumps(model_dict.get('params', {})))}).</p>"
    )


def boundary_search_plot(fit_info: dict) -> str:
    """Cross-validated error of each candidate segment boundary, against the single-segment model."""
    search = (fit_info or {}).get("boundary_search") or {}
    candidates = search.get("candidates") or {}
    none = candidates.get("none")
    points = sorted(
        (c["boundary_new_tokens"], c["cv_mean_squared_rel_err"], c.get("cv_standard_error") or 0.0)
        for c in candidates.values()
        if c.get("boundary_new_tokens") is not None and "cv_mean_squared_rel_err" in c
    )
    skipped = sorted(c["boundary_new_tokens"] for c in candidates.values() if c.get("skipped"))
    if not points and not none:
        return "<p>No boundary search was run (segments fixed by the caller).</p>"
    figure, axis = plt.subplots(figsize=(9, 4))
    if points:
        x, y, se = (np.array(v) for v in zip(*points))
        axis.errorbar(x, y * 100, yerr=se * 100, fmt="-o", ms=4, capsize=3, color=MODEL_COLORS["llmvisor"], label="two segments, boundary at x (±1 SE)")
    if none:
        mean, se = none["cv_mean_squared_rel_err"] * 100, (none.get("cv_standard_error") or 0.0) * 100
        axis.axhline(mean, color="black", linewidth=1, label="one segment (no boundary)")
        axis.axhspan(mean - se, mean + se, color="gray", alpha=0.2, label="one segment ± 1 SE")
    chosen = search.get("chosen")
    if chosen not in (None, "none") and chosen in candidates:
        axis.axvline(candidates[chosen]["boundary_new_tokens"], color="#d62728", linestyle="--", label=f"chosen: {chosen} tokens")
    axis.set_xscale("log")
    axis.set_xlabel("segment boundary (new tokens per step)")
    axis.set_ylabel("CV mean squared relative error (%)")
    axis.set_title(f"boundary search, {search.get('n_folds', '?')}-fold CV ({search.get('fold_grouping', '')})")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    chosen_text = "no boundary (one segment)" if chosen in (None, "none") else f"a boundary at {chosen} new tokens per step"
    note = f"<p class='note'>Rule: {html.escape(search.get('rule', ''))}. Chosen: {chosen_text}."
    if skipped:
        note += f" Not scored (a segment had too few or rank-deficient steps): {', '.join(f'{b:g}' for b in skipped)}."
    return img_tag(figure_png_base64(figure), "cross-validated error per candidate boundary") + note + "</p>"


def coverage_plots(trace: StepTrace, engine: dict | None = None) -> str:
    """Where the sweep's steps lie in the engine envelope: batch size × context, and tokens per step by step kind."""
    steps = trace.select_steps(~warmup_mask_per_step(trace))
    if steps.n_steps == 0:
        return "<p>No steps outside warm-up.</p>"
    starts = steps.step_starts
    batch = steps.batch_size_per_step.astype(np.float64)
    context = np.add.reduceat(steps.num_context_tokens.astype(np.float64), starts)
    new_tokens = np.add.reduceat(steps.num_new_tokens.astype(np.float64), starts)
    n_prefill = np.add.reduceat(steps.is_prefill.astype(np.int64), starts)
    kinds = {"pure decode": n_prefill == 0, "mixed (chunked prefill + decode)": (n_prefill > 0) & (n_prefill < batch), "pure prefill": n_prefill == batch}
    engine = engine or {}
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    cells = left.hexbin(batch, np.maximum(context, 1), gridsize=(32, 24), yscale="log", bins="log", mincnt=1, cmap="viridis")
    figure.colorbar(cells, ax=left, label="steps (log scale)")
    if engine.get("max_num_seqs"):
        left.axvline(engine["max_num_seqs"], color="#d62728", linestyle="--", linewidth=1, label=f"max_num_seqs = {engine['max_num_seqs']}")
        left.legend(fontsize=8, loc="lower right")
    left.set_xlabel("batch size (requests in the step)")
    left.set_ylabel("context tokens in the step (Σ c, log)")
    left.set_title("batch size × context")
    bins = np.logspace(0, np.log10(max(new_tokens.max(), 2)) + 0.05, 40)
    right.hist([new_tokens[mask] for mask in kinds.values()], bins=bins, stacked=True, label=[f"{k} ({int(m.sum()):,})" for k, m in kinds.items()], color=["#1f77b4", "#9467bd", "#ff7f0e"])
    if engine.get("max_num_batched_tokens"):
        right.axvline(engine["max_num_batched_tokens"], color="#d62728", linestyle="--", linewidth=1, label=f"max_num_batched_tokens = {engine['max_num_batched_tokens']}")
    right.set_ylim(0, right.get_ylim()[1] * 1.4)
    right.set_xscale("log")
    right.set_xlabel("new tokens in the step (Σ p, log)")
    right.set_ylabel("steps")
    right.set_title("tokens per step, by step kind")
    right.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    return img_tag(figure_png_base64(figure), "sweep coverage: batch size by context, tokens per step")


def step_counts_note(trace: StepTrace, fit_info: dict, coverage: dict | None) -> str:
    """Why the sweep's step counts differ between the trace, the coverage summary and the fit."""
    total = int(trace.n_steps)
    warmup = int(fit_info.get("n_warmup_dropped", 0))
    outliers = int(fit_info.get("n_outliers_dropped", 0))
    drifted = int(fit_info.get("n_drifted_dropped", 0))
    used = int(fit_info.get("n_steps_used", 0))
    covered = (coverage or {}).get("n_steps")
    rule = trace.metadata.get("warmup_rule")
    relabelled = trace.metadata.get("warmup_relabelled")
    warmup_text = f"{warmup:,} steps are marked warm-up (<code>is_warmup</code>)"
    if rule:
        warmup_text += f": {html.escape(rule.removeprefix('is_warmup: '))}"
    if relabelled:
        warmup_text += f". Relabelled {html.escape(relabelled)}"
    items = [f"The sweep trace holds {total:,} steps.", warmup_text + "."]
    if covered is not None:
        items.append(f"Coverage (below) counts the steps that are not warm-up: {covered:,}.")
    items.append(
        f"The fit leaves out the same warm-up steps and {drifted:,} steps flagged <code>is_drifted</code> by the sweep's "
        f"drift canaries, then drops {outliers:,} outlier steps "
        f"({html.escape(str(fit_info.get('outlier_rule', 'outlier rule')))}): it is fitted on {used:,} steps."
    )
    return "<p class='note'>Step counts:</p><ul class='note'>" + "".join(f"<li>{item}</li>" for item in items) + "</ul>"


def json_links(links: dict[str, str]) -> str:
    """Links to the raw JSON files written next to index.html, each with what it holds."""
    items = "".join(f"<li><a href='{html.escape(name)}'>{html.escape(name)}</a>: {html.escape(what)}</li>" for name, what in links.items())
    return f"<ul>{items}</ul>"


def write_report(
    folder: Path,
    sections: list[tuple[str, str]],
    *,
    title: str = "llmvisor report",
    data: dict | None = None,
    files: dict[str, dict] | None = None,
) -> Path:
    """Write ``index.html`` (and ``summary.json`` when ``data`` is given, and each of ``files`` as JSON) into
    ``folder``; returns the HTML path."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (files or {}).items():
        (folder / name).write_text(json.dumps(content, indent=2, default=float) + "\n", encoding="utf-8")
    body = "\n".join(f"<section><h2>{html.escape(heading)}</h2>{content}</section>" for heading, content in sections)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1180px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:first-child, td:nth-child(2), .text {{ text-align: left; }} img {{ max-width: 100%; }} section {{ margin-bottom: 2em; }}
p.note, ul.note {{ color: #555; }} .number {{ white-space: nowrap; }}
</style></head><body><h1>{html.escape(title)}</h1>
{body}
</body></html>
"""
    path = folder / "index.html"
    path.write_text(page, encoding="utf-8")
    if data is not None:
        (folder / "summary.json").write_text(json.dumps(data, indent=2, default=float) + "\n", encoding="utf-8")
    return path
