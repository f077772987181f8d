"""The validation result for people: HTML report sections (tables, scatter, error CDFs) and Markdown tables."""

from __future__ import annotations

import html

import numpy as np

from llmvisor.plots import figure_png_base64, img_tag
from llmvisor.validation.analysis import GOAL, HEADLINE_METHOD, METHOD_NOTES, Method, upgrade_result
from llmvisor.validation.plans import PHASES, BatchKind

REPORT_METHODS = (
    Method.SHAPLEY,
    Method.SHAPLEY_PREDICTED,
    Method.PROPORTIONAL,
    Method.PAPER,
    Method.TOKEN_COUNT,
    Method.EQUAL_SPLIT,
)
"""One scatter panel and one CDF curve each (plus `Method.MODEL_EXACT_SHAPLEY` on the CDF)."""
MARKDOWN_METHODS = (
    Method.SHAPLEY,
    Method.SHAPLEY_PREDICTED,
    Method.PROPORTIONAL,
    Method.PROPORTIONAL_PREDICTED,
    Method.PAPER,
    Method.TOKEN_COUNT,
    Method.EQUAL_SPLIT,
    Method.KV_TOKENS_PROPORTIONAL,
    Method.MEASURED_ADDITIVE_FIT,
)
METHOD_COLORS = {
    Method.SHAPLEY: "#1f77b4",
    Method.SHAPLEY_PREDICTED: "#17becf",
    Method.PROPORTIONAL: "#9467bd",
    Method.PAPER: "#ff7f0e",
    Method.TOKEN_COUNT: "#d62728",
    Method.EQUAL_SPLIT: "#7f7f7f",
    Method.MODEL_EXACT_SHAPLEY: "#2ca02c",
    Method.KV_TOKENS_PROPORTIONAL: "#8c564b",
}


def _fractions(records: list[dict], method: str, target: str = "shapley") -> tuple[np.ndarray, np.ndarray]:
    truth, share = [], []
    for r in records:
        truth.extend(np.asarray(r[f"{target}_s"]) / r["measured_step_s"])
        share.extend(np.asarray(r["shares_s"][method]) / r["measured_step_s"])
    return np.array(truth), np.array(share)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _summary_table(summary: dict, target: str = "shapley") -> str:
    methods = [m for m in summary.get("methods", []) if m != Method.MEASURED_ADDITIVE_FIT] + [Method.MEASURED_ADDITIVE_FIT]
    rows = []
    for phase, tables in summary.get("errors", {}).items():
        for method in methods:
            m = tables[target].get(method)
            if not m:
                continue
            cells = [method, phase, str(m["n"])]
            for q in (50, 90, 99):
                ci = m.get(f"p{q}_ci95")
                cells.append(_pct(m[f"p{q}"]) + (f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else ""))
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("method", "phase", "requests", "p50 [95% CI]", "p90 [95% CI]", "p99 [95% CI]"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def report_sections(validation: dict) -> list[tuple[str, str]]:
    """HTML sections for the report: summary tables, share-vs-Shapley scatter, error CDFs per rule."""
    validation = upgrade_result(validation)
    records = validation.get("batches", [])
    summary = validation.get("summary") or {}
    if not records or not summary:
        return [("Validation against measured Shapley values", "<p>No validation result.</p>")]
    settings = validation.get("settings", {})
    floor = summary.get("noise_floor", {})
    notes = validation.get("method_notes", METHOD_NOTES)
    intro = (
        f"<p>{validation['n_batches_measured']} batches ({summary['n_batches'].get('prefill', 0)} prefill, "
        f"{summary['n_batches'].get('decode', 0)} decode; sizes {settings.get('min_batch', 2)}–{settings.get('max_batch', '?')}) were run "
        f"on {html.escape(str(settings.get('engine', 'the engine')))} as controlled steps: every non-empty subset of each batch as a step of its own, "
        f"{settings.get('repeat', '?')} times, median kept. Each request's exact Shapley value of the measured game is the ground truth. "
        "Errors are |share − measured Shapley| as a fraction of the measured step time; intervals are bootstrap 95% over batches.</p>"
    )
    gap_parts = [
        f"{phase}: median {_pct(g.get('p50'))} (p10 {_pct(g.get('p10'))}, p90 {_pct(g.get('p90'))})"
        for phase, g in summary.get("loo_sum_gap_fraction", {}).items()
        if g.get("n")
    ]
    floor_parts = [
        f"{phase}: p50 {_pct(f.get('p50'))}, p90 {_pct(f.get('p90'))}, p99 {_pct(f.get('p99'))} ({f.get('n_batches', 0)} batches measured twice)"
        for phase, f in floor.get("shapley", {}).items()
        if f.get("n")
    ]
    notes_html = "<ul>" + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in notes.items()) + "</ul>"
    sections = [
        (
            "Validation: shares vs measured Shapley values",
            intro
            + _summary_table(summary)
            + f"<p>Leave-one-out marginal costs sum to T(B) − Σ LOO short of the step by (Σ LOO − T) / T = {'; '.join(gap_parts)}.</p>"
            + f"<p>Noise floor of a measured Shapley value (two independent measurements, |Δφ| / (√2·T)): {'; '.join(floor_parts) or 'not measured'}.</p>"
            + f"<p class='note'>Methods:</p>{notes_html}",
        ),
        ("Validation: shares vs leave-one-out marginal cost", _summary_table(summary, "loo")),
    ]

    phases = [p for p in PHASES if any(r["phase"] == p for r in records)]
    methods = [m for m in REPORT_METHODS if m in records[0]["shares_s"]]
    scatter = img_tag(figure_png_base64(share_scatter_figure(records, phases, methods)), "share vs measured Shapley value per method and phase")
    cdf = img_tag(figure_png_base64(error_cdf_figure(records, floor, phases, methods)), "error CDF per method with the noise floor")
    sections.append(("Validation: share vs measured Shapley (each point a request)", scatter))
    sections.append(("Validation: error CDF per rule", cdf))
    return sections


def share_scatter_figure(records: list[dict], phases: list[str], methods: list[str]):
    """One panel per phase and method: each request's share against its measured Shapley value (fractions of the step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(phases), len(methods), figsize=(3.0 * len(methods), 3.0 * len(phases)), squeeze=False)
    for row, phase in enumerate(phases):
        phase_records = [r for r in records if r["phase"] == phase]
        for col, method in enumerate(methods):
            axis = axes[row][col]
            truth, share = _fractions(phase_records, method)
            adversarial = np.concatenate([[r["kind"] == BatchKind.ADVERSARIAL] * r["size"] for r in phase_records])
            axis.scatter(truth[~adversarial], share[~adversarial], s=7, alpha=0.6, color=METHOD_COLORS.get(method), label="workload batches")
            axis.scatter(truth[adversarial], share[adversarial], s=12, alpha=0.8, marker="x", color="black", label="adversarial batches")
            high = max(float(truth.max()), float(share.max()), 0.05) * 1.05
            axis.plot([0, high], [0, high], color="black", linewidth=0.7)
            axis.set_xlim(0, high)
            axis.set_ylim(0, high)
            axis.set_title(f"{method} ({phase})", fontsize=8)
            axis.tick_params(labelsize=7)
            if col == 0:
                axis.set_ylabel("share / measured step", fontsize=8)
            if row == len(phases) - 1:
                axis.set_xlabel("measured Shapley / step", fontsize=8)
    # Above all panels, so no point is hidden.
    figure.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    return figure


def error_cdf_figure(records: list[dict], floor: dict, phases: list[str], methods: list[str]):
    """One panel per phase: the CDF of |share − measured Shapley| / step per method, with the noise floor and goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.2), squeeze=False)
    for axis, phase in zip(axes[0], phases):
        phase_records = [r for r in records if r["phase"] == phase]
        drawn: dict[str, np.ndarray] = {}
        for method in methods + [Method.MODEL_EXACT_SHAPLEY]:
            if method not in phase_records[0]["shares_s"]:
                continue
            truth, share = _fractions(phase_records, method)
            errors = np.sort(np.abs(share - truth))
            same = next((name for name, e in drawn.items() if e.shape == errors.shape and np.allclose(e, errors, rtol=0, atol=1e-9)), None)
            if same is not None:  # identical curve (e.g. token_count = equal_split for decode): say so, draw once
                axis.plot([], [], color=METHOD_COLORS.get(method), label=f"{method} (= {same})")
                continue
            drawn[method] = errors
            width = 2.2 if method == HEADLINE_METHOD else 1.2
            axis.plot(errors * 100, np.linspace(0, 1, errors.size), label=method, color=METHOD_COLORS.get(method), linewidth=width)
        f = floor.get("shapley", {}).get(phase, {})
        for q, style in (("p50", ":"), ("p90", "--")):
            if f.get(q) is not None:
                axis.axvline(f[q] * 100, color="gray", linestyle=style, linewidth=1, label=f"noise floor {q}")
        axis.axvline(GOAL["p90_max"] * 100, color="green", linestyle="-.", linewidth=0.8, label="goal p90")
        axis.set_xscale("symlog", linthresh=1)
        axis.set_xlim(left=0)
        axis.set_xlabel("|share − measured Shapley| / step time (%)")
        axis.set_ylabel("fraction of requests")
        axis.set_title(f"error CDF, {phase}")
        # Below the axes (and their x label): inside, it covered the shapley curve on decode.
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    figure.subplots_adjust(wspace=0.25)
    return figure


BILLING_METHODS = (
    Method.SHAPLEY,
    Method.SHAPLEY_PREDICTED,
    Method.PROPORTIONAL,
    Method.PAPER,
    Method.TOKEN_COUNT,
    Method.EQUAL_SPLIT,
    Method.KV_TOKENS_PROPORTIONAL,
    Method.MEASURED_ADDITIVE_FIT,
)
"""Columns of the class-bias table (every method has a row of the per-request table)."""


def billing_tables(summary: dict) -> list[str]:
    """Markdown: per-request relative error (a request's own bill) and per-class bias (a tenant's monthly bill)."""
    def pct(x):
        return "–" if x is None else f"{100 * x:.1f}%"

    def signed(x):
        return f"{100 * x:+.1f}%" if round(100 * x, 1) != 0 else "0.0%"

    per_request = summary.get("per_request_error")
    if not per_request:
        return []
    floor = next(iter(next(iter(per_request.values())).values()))["floor_fraction_of_step"]
    lines = [f"|share − measured Shapley value| / measured Shapley value, per request (requests with a measured value of at "
             f"least {pct(floor)} of the step):", "",
             "| phase | method | requests | below the floor | p50 [95% CI] | p90 [95% CI] | p99 |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for phase, tables in per_request.items():
        for method in MARKDOWN_METHODS:
            m = tables.get(method)
            if not m:
                continue
            cells = [pct(m[f"p{q}"]) + (f" [{pct(m[f'p{q}_ci95'][0])}, {pct(m[f'p{q}_ci95'][1])}]" if m.get(f"p{q}_ci95") else "")
                     for q in (50, 90)]
            lines.append(f"| {phase} | {method} | {m['n']} | {m['n_below_floor']} | {cells[0]} | {cells[1]} | {pct(m['p99'])} |")
    lines += ["", "Bias of a class's bill, Σ shares / Σ measured Shapley − 1 [95% CI, batches resampled]:", "",
              "| class | requests | " + " | ".join(BILLING_METHODS) + " |", "| --- | ---: |" + " ---: |" * len(BILLING_METHODS)]
    for name, by_method in summary.get("class_bias", {}).items():
        first = next(iter(by_method.values()))
        cells = []
        for method in BILLING_METHODS:
            b = by_method.get(method)
            cells.append("–" if b is None else signed(b["bias"]) + (f" [{signed(b['ci95'][0])}, {signed(b['ci95'][1])}]" if b.get("ci95") else ""))
        lines.append(f"| {name} | {first['n']} | " + " | ".join(cells) + " |")
    sizes = summary.get("batch_sizes")
    if sizes:
        lines += ["", f"Batch sizes: {sizes['min']}–{sizes['max']} requests ("
                  + "; ".join(f"{k}: {v['min']}–{v['max']}, {v['n_batches']} batches" for k, v in sizes["by_kind"].items()) + ")."]
    return lines + [""]


def markdown_summary(validation: dict) -> str:
    """The result's headline tables in Markdown (what docs/validation.md quotes), so the figures are regenerable."""
    summary = upgrade_result(validation)["summary"]
    def pct(x):
        return "–" if x is None else f"{100 * x:.1f}%"

    def cell(m: dict, q: int) -> str:
        ci = m.get(f"p{q}_ci95")
        return pct(m[f"p{q}"]) + (f" [{pct(ci[0])}, {pct(ci[1])}]" if ci else "")

    lines = []
    for target, title in (("shapley", "measured Shapley value"), ("loo", "leave-one-out marginal cost")):
        lines += [f"|share − {title}| / measured step time:", "",
                  "| phase | method | requests | p50 [95% CI] | p90 [95% CI] | p99 [95% CI] | p90 gain vs token_count |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for phase, tables in summary["errors"].items():
            token_p90 = tables[target][Method.TOKEN_COUNT]["p90"]
            for method in MARKDOWN_METHODS:
                m = tables[target].get(method)
                if not m:
                    continue
                gain = token_p90 / m["p90"] if m["p90"] else None
                lines.append(f"| {phase} | {method} | {m['n']} | {cell(m, 50)} | {cell(m, 90)} | {cell(m, 99)} | "
                             f"{'–' if gain is None else f'{gain:.2f}×'} |")
        lines.append("")
    lines += billing_tables(summary)
    lines += ["| phase | kind | requests | shapley p90 | token_count p90 | equal_split p90 | measured_additive_fit p90 |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for phase, kinds in summary["errors_by_kind"].items():
        for kind, t in kinds.items():
            lines.append(f"| {phase} | {kind} | {t['shapley']['n']} | {pct(t['shapley']['p90'])} | {pct(t['token_count']['p90'])} | "
                         f"{pct(t['equal_split']['p90'])} | {pct(t['measured_additive_fit']['p90'])} |")
    lines += ["", "| phase | noise floor of a measured Shapley value p50 / p90 / p99 | step repeat spread p50 / p90 / p99 | (Σ LOO − T) / T p10 / p50 / p90 |",
              "| --- | ---: | ---: | ---: |"]
    for phase in summary["errors"]:
        f = summary["noise_floor"]["shapley"][phase]
        st = summary["noise_floor"]["step"][phase]
        g = summary["loo_sum_gap_fraction"][phase]
        lines.append(f"| {phase} | {cell(f, 50)} / {cell(f, 90)} / {cell(f, 99)} ({f['n_batches']} batches) | "
                     f"{pct(st['p50'])} / {pct(st['p90'])} / {pct(st['p99'])} | {pct(g['p10'])} / {pct(g['p50'])} / {pct(g['p90'])} |")
    lines += ["", "| phase | additive fit RMS residual p50 / p90 | shared cost (additive fit) share of step p10 / p50 / p90 | model's subset-step error p50 / p90 |",
              "| --- | ---: | ---: | ---: |"]
    for phase, a in summary["additivity"].items():
        lines.append(f"| {phase} | {pct(a['rms_residual_fraction']['p50'])} / {pct(a['rms_residual_fraction']['p90'])} | "
                     f"{pct(a['intercept_fraction_of_step']['p10'])} / {pct(a['intercept_fraction_of_step']['p50'])} / {pct(a['intercept_fraction_of_step']['p90'])} | "
                     f"{pct(a['model_subset_rel_err']['p50'])} / {pct(a['model_subset_rel_err']['p90'])} |")
    lines += ["", "| phase | candidate non-additive term | coefficient (s per unit) | t | share of the additive residual explained |",
              "| --- | --- | ---: | ---: | ---: |"]
    for phase, d in summary.get("interactions", {}).items():
        for name, t in d["terms"].items():
            lines.append(f"| {phase} | {name} | {t['coef']:.3g} ± {t['std_err']:.2g} | {t['t']:.1f} | {pct(t['explained_fraction_of_additive_residual'])} |")
    sampled = summary.get("sampled") or {}
    if sampled:
        lines += ["", "| serving-size kind | batches | sizes | orders | requests | estimate's 95% half-width p50 / p90 | shapley p50 / p90 | token_count p50 / p90 | equal_split p50 / p90 |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for kind, s in sampled.items():
            e = s["errors"]
            width = s["estimate_ci95_half_width_fraction_of_step"]
            lines.append(
                f"| {kind} | {s['n_batches']} | {'/'.join(map(str, s['sizes']))} | {'/'.join(map(str, s['n_orders']))} | {s['n_requests']} | "
                f"{pct(width['p50'])} / {pct(width['p90'])} | {pct(e['shapley']['p50'])} / {pct(e['shapley']['p90'])} | "
                f"{pct(e['token_count']['p50'])} / {pct(e['token_count']['p90'])} | {pct(e['equal_split']['p50'])} / {pct(e['equal_split']['p90'])} |"
            )
    agreement = summary.get("sampler_agreement")
    if agreement:
        a = agreement["abs_error_fraction_of_step"]
        lines += ["", f"Sampler against exact enumeration on the {agreement['n_batches']} exact batches ({agreement['n_orders']} orders from their "
                  f"measured subsets): |φ̂ − φ| / T p50 {cell(a, 50)}, p90 {cell(a, 90)}; 95% intervals hold the exact value for "
                  f"{100 * agreement['ci95_coverage']:.0f}% of {a['n']} requests."]
    return "\n".join(lines) + "\n"


COALITION_KIND_LABELS = {"decode": "decode", "shared_prefix_decode": "shared-prefix decode", "mixed_sharing_decode": "mixed-sharing decode",
                         "prefill": "prefill", "mixed": "mixed"}
CLASS_LABELS = {"shared": "shared-prefix readers", "unique": "own contexts", "largest_group": "largest group",
                "middle_group": "middle group", "smallest_group": "smallest group", "first_readers": "first readers",
                "later_readers": "later readers", "long_readers": "long readers", "short_readers": "short readers",
                "longest_readers": "longest readers", "shortest_readers": "shortest readers"}


def _interval(entry: dict | None) -> str:
    if entry is None:
        return "–"
    low, high = entry["ci95"]
    return f"{100 * entry['bias']:+.1f}% [{100 * low:+.1f}%, {100 * high:+.1f}%]".replace("+-", "-")


def coalitions_markdown_summary(result: dict) -> str:
    """docs/validation.md's tables of a coalitions-design result (``validation-coalitions.json``), so the doc quotes the
    file and nothing else (tests/test_validation_coalitions_doc.py)."""
    summary = result["summary"]
    estimator, sampled, sizes = summary["estimator"], summary["sampled"], summary["batch_sizes"]
    exact = estimator.get("exact") or {}
    lines = [
        f"{sizes['n_serving_size_batches']} serving-size batches of {', '.join(map(str, sizes['serving_size']))} requests "
        f"(largest {sizes['max']}) and {sizes['n_exact_batches']} exact mixed-sharing batches: {sizes['n_steps_used']:,} controlled "
        f"steps used, {sizes['n_disturbed_steps_left_out']:,} the interference guard kept after every redo was disturbed left out "
        f"({sizes['n_interference_flagged_excluded']} batches left out whole).",
        "",
        f"Exact mixed-sharing batches ({', '.join(map(str, exact.get('sizes', [])))} requests, every subset measured twice): the "
        f"regression's 95% intervals from 2n+1 and 4n+1 coalitions of one repeat cover the exact value of the other repeat for "
        f"{_pct(estimator['exact_coverage_95'])} of requests.",
        "",
        "| requests | regression half-width ÷ step (p50) | permutation at equal steps (projected) | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for size, row in estimator["halfwidth_ratio_detail"].items():
        lines.append(f"| {size} | {_pct(row['regression_halfwidth_over_step_p50'])} | "
                     f"{_pct(row['permutation_halfwidth_over_step_p50_projected'])} | {row['ratio']:.2f}× |")
    lines += [
        "",
        "| batch kind | batches | 95% half-width ÷ share (p50) | `shapley` p50 / p90 / p99 vs estimate | `token_count` p90 | p90 ≤ 10% | ≥ 2× `token_count` |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, row in sampled["by_kind"].items():
        err = row["relative_error_vs_estimate"]
        lines.append(
            f"| {COALITION_KIND_LABELS.get(kind, kind)} | {row['n_batches']} | {_pct(row['halfwidth_over_share_p50'])} | "
            f"{_pct(err['shapley']['p50'])} / {_pct(err['shapley']['p90'])} / {_pct(err['shapley']['p99'])} | "
            f"{_pct(err['token_count']['p90'])} | {row['goal_p90']} | {row['goal_vs_token_count']} |")
    if sampled.get("by_size"):
        lines += [
            "",
            "Per size (half-width scales as 1/√(measured coalitions): the last column is the steps a batch like these "
            "would need for a median half-width of 25% of its share at this noise):",
            "",
            "| requests | batch kind | batches | steps per batch (p50) | 95% half-width ÷ share (p50) | steps for 25% |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for size, kinds in sampled["by_size"].items():
            for kind, row in kinds.items():
                lines.append(f"| {size} | {COALITION_KIND_LABELS.get(kind, kind)} | {row['n_batches']} | {row['steps_per_batch_p50']:.0f} | "
                             f"{_pct(row['halfwidth_over_share_p50'])} | {row['steps_for_halfwidth_quarter']:,} |")
    own_terms = summary.get("sharing_own_terms") or {}
    checks = [(label, entry, "priced with the model") for label, entry in summary["sharing"].items()]
    checks += [(label, entry, "priced with the run's own terms (llmvisor's fit on the other request sets' steps)")
               for label, entry in own_terms.items() if label in ("exact", "serving_size")]
    if own_terms.get("not_fitted"):
        lines += ["", f"Sharing priced with the run's own terms: not fitted ({own_terms['not_fitted']})."]
    for label, entry, pricing in checks:
        lines += [
            "",
            f"Sharing, {'exact' if label == 'exact' else 'serving-size'} mixed-sharing batches ({entry['n_batches']} "
            f"batches of {', '.join(map(str, entry['sizes']))} requests), {pricing}: class bias of the `shapley` shares, "
            "Σ shares ÷ Σ values − 1 [95%].",
            "",
            "| sharing rule | " + " | ".join(CLASS_LABELS[c] for c in CLASS_LABELS if c in entry["rules"][next(iter(entry["rules"]))]["class_bias"])
            + " | flagged |",
            "| --- |" + " --- |" * (1 + sum(c in entry["rules"][next(iter(entry["rules"]))]["class_bias"] for c in CLASS_LABELS)),
        ]
        for rule, row in entry["rules"].items():
            cells = [_interval(row["class_bias"].get(c)) for c in CLASS_LABELS if c in row["class_bias"]]
            lines.append(f"| {rule.replace('_', ' ')} | " + " | ".join(cells) + f" | {'yes' if row['flagged'] else 'no'} |")
    cost = summary.get("measurement_cost")
    if cost and cost.get("wall_s"):
        lines += ["", f"Measuring cost: {cost['n_runs']} runs, {cost['wall_s'] / 60:.1f} min in all (engine starts included) for "
                  f"{cost['n_steps_measured']:,} measured steps, {cost['steps_per_wall_s']:.1f} steps/s; the steps themselves took "
                  f"{_pct(cost['step_time_fraction'])} of it ({cost['steps_per_step_s']:.0f} steps per second of step time), the canaries "
                  f"{cost['canary_time_s']:.0f} s, and {_pct(cost['other_fraction'])} went to engine starts, prefilling each batch's contexts, "
                  "preparing held contexts again per chunk and the loop around the steps."]
    additivity, floor = summary["additivity"], summary["noise_floor"]["relative_per_measurement"]
    if additivity.get("per_batch"):
        lines += ["", f"Additivity against each batch's own replicates: rejected at 5% for {_pct(additivity['rejected_fraction_5pct'])} of "
                  f"{len(additivity['per_batch'])} serving-size batches (misfit ÷ noise p50 {additivity['misfit_over_noise']['p50']:.2f}); "
                  f"replicate noise floor of one step p50 {_pct(floor['p50'])} [{_pct(floor['interval']['p50'][0])}, "
                  f"{_pct(floor['interval']['p50'][1])}], p90 {_pct(floor['p90'])} [{_pct(floor['interval']['p90'][0])}, "
                  f"{_pct(floor['interval']['p90'][1])}]."]
    return "\n".join(lines)
