"""A self-contained HTML report (plots embedded as PNG) of an evaluation, attribution and validation."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from llmvisor.evaluation.heldout import relative_errors, steady_steps  # noqa: E402
from llmvisor.core.trace import StepTrace  # noqa: E402

MODEL_COLORS = {"llmvisor": "#1f77b4", "paper_ols": "#ff7f0e", "token_count": "#d62728", "random_forest": "#2ca02c"}


def figure_png_base64(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def img_tag(encoded: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'


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


def write_report(folder: Path, sections: list[tuple[str, str]], *, title: str = "llmvisor report", data: dict | None = None) -> Path:
    """Write ``index.html`` (and ``summary.json`` when ``data`` is given) into ``folder``; returns the HTML path."""
    folder.mkdir(parents=True, exist_ok=True)
    body = "\n".join(f"<section><h2>{html.escape(heading)}</h2>{content}</section>" for heading, content in sections)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1180px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:first-child, td:nth-child(2) {{ text-align: left; }} img {{ max-width: 100%; }} section {{ margin-bottom: 2em; }}
p.note {{ color: #555; }}
</style></head><body><h1>{html.escape(title)}</h1>
{body}
</body></html>
"""
    path = folder / "index.html"
    path.write_text(page, encoding="utf-8")
    if data is not None:
        (folder / "summary.json").write_text(json.dumps(data, indent=2, default=float) + "\n", encoding="utf-8")
    return path
