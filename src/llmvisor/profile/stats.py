"""Summaries of a recorded trace: how it covers the engine envelope, and its noise floor."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from llmvisor.core.stats import quantile_summary, replicate_noise_floor
from llmvisor.core.trace import StepTrace

QUANTILES = (0, 10, 50, 90, 100)
"""Percentiles of each coverage summary, named ``QUANTILE_NAMES``."""
QUANTILE_NAMES = ("min", "p10", "p50", "p90", "max")


def warmup_mask_per_step(trace: StepTrace) -> np.ndarray:
    """True for steps the recorder marked as warm-up (column ``is_warmup``), per step; the trace's own
    reading of the column (``llmvisor.core.trace.parse_is_warmup``), so the profiler and the fit agree."""
    return trace.is_warmup_per_step


def mark_warmup_window(trace: StepTrace, seconds: float) -> int:
    """Also mark as warm-up every step that starts within `seconds` of the trace's first step; returns how many
    steps are marked now. Needs the ``timestamp_s`` column (the recorder writes it)."""
    if seconds > 0 and trace.n_slices and "timestamp_s" in trace.extra:
        timestamp = np.asarray(trace.extra["timestamp_s"], dtype=float)
        flags = np.zeros(trace.n_slices, dtype=bool)
        if "is_warmup" in trace.extra:
            flags = np.repeat(warmup_mask_per_step(trace), trace.batch_size_per_step)
        trace.extra["is_warmup"] = flags | (timestamp < timestamp.min() + seconds)
    return int(warmup_mask_per_step(trace).sum())


def composition_keys(trace: StepTrace) -> list[tuple]:
    """Per step, the multiset of (num_new_tokens, num_context_tokens, is_prefill) of its slices."""
    keys = []
    for k in range(trace.n_steps):
        lo, hi = trace.step_offsets[k], trace.step_offsets[k + 1]
        keys.append(
            tuple(
                sorted(
                    zip(
                        trace.num_new_tokens[lo:hi].tolist(),
                        trace.num_context_tokens[lo:hi].tolist(),
                        trace.is_prefill[lo:hi].tolist(),
                    )
                )
            )
        )
    return keys


def noise_floor(trace: StepTrace, *, n_resamples: int = 1000, seed: int = 0) -> dict | None:
    """The one noise floor (`llmvisor.core.stats.replicate_noise_floor`) over groups of steps of identical
    composition (warm-up steps left out), with its bootstrap interval over the groups.

    Only compositions seen at least twice count; None when there are none (no ``--repeat``). ``n_steps`` is how
    many steps the floor was computed from (``n_measurements``)."""
    latency = trace.step_latency_s_per_step
    usable = ~warmup_mask_per_step(trace)
    groups: dict[tuple, list[float]] = defaultdict(list)
    for key, t, ok in zip(composition_keys(trace), latency.tolist(), usable.tolist()):
        if ok:
            groups[key].append(t)
    floor = replicate_noise_floor(groups.values(), n_resamples=n_resamples, seed=seed)
    if floor is None:
        return None
    return {**floor, "n_steps": floor["n_measurements"], "groups": "steps of identical composition, warm-up steps excluded"}


def _quantiles(values: np.ndarray) -> dict:
    return quantile_summary(values, QUANTILES, names=QUANTILE_NAMES)


def coverage(trace: StepTrace, envelope: dict | None = None) -> dict:
    """Ranges and quantiles of batch size, Σp and c, p per phase; step kinds; reach of the envelope."""
    usable = ~warmup_mask_per_step(trace)
    steps = trace.select_steps(usable)
    if steps.n_steps == 0:
        return {"n_steps": 0}
    starts = steps.step_starts
    batch = steps.batch_size_per_step
    total_new = np.add.reduceat(steps.num_new_tokens, starts)
    n_prefill_slices = np.add.reduceat(steps.is_prefill.astype(np.int64), starts)
    pure_prefill = n_prefill_slices == batch
    pure_decode = n_prefill_slices == 0
    mixed = ~pure_prefill & ~pure_decode
    prefill, decode = steps.is_prefill, ~steps.is_prefill
    summary = {
        "n_steps": int(steps.n_steps),
        "n_slices": int(steps.n_slices),
        "step_kinds": {
            "pure_prefill": int(pure_prefill.sum()),
            "pure_decode": int(pure_decode.sum()),
            "mixed": int(mixed.sum()),
        },
        "batch_size": _quantiles(batch.astype(float)),
        "decode_batch_size_pure_decode_steps": _quantiles(batch[pure_decode].astype(float)),
        "step_new_tokens": _quantiles(total_new.astype(float)),
        "prefill_new_tokens": _quantiles(steps.num_new_tokens[prefill].astype(float)),
        "prefill_context_tokens": _quantiles(steps.num_context_tokens[prefill].astype(float)),
        "decode_context_tokens": _quantiles(steps.num_context_tokens[decode].astype(float)),
        "step_latency_s": _quantiles(steps.step_latency_s_per_step),
    }
    if envelope:
        context = steps.num_context_tokens + steps.num_new_tokens
        summary["envelope_reached"] = {
            "batch_size / max_num_seqs": float(batch.max() / envelope["max_num_seqs"]),
            "step tokens / max_num_batched_tokens": float(total_new.max() / envelope["max_num_batched_tokens"]),
            "context + new / max_model_len": float(context.max() / envelope["max_model_len"]),
        }
    return summary


COVERAGE_ROWS = (
    ("batch size (all steps)", "batch_size"),
    ("batch size (pure decode steps)", "decode_batch_size_pure_decode_steps"),
    ("Σp per step", "step_new_tokens"),
    ("p, prefill slices", "prefill_new_tokens"),
    ("c, prefill slices", "prefill_context_tokens"),
    ("c, decode slices", "decode_context_tokens"),
    ("step latency (ms)", "step_latency_s"),
)


def print_coverage(console, summary: dict) -> None:
    """A rich table of `coverage`'s result."""
    from rich.table import Table

    if not summary.get("n_steps"):
        console.print("coverage: no steps recorded")
        return
    kinds = summary["step_kinds"]
    table = Table(title=f"Envelope coverage ({summary['n_steps']} steps, warm-up excluded)")
    table.add_column("quantity")
    for name in (*QUANTILE_NAMES, "n"):
        table.add_column(name, justify="right")
    for label, key in COVERAGE_ROWS:
        q = summary[key]
        scale = 1000.0 if key == "step_latency_s" else 1.0
        cells = ["-" if q[name] is None else f"{q[name] * scale:,.1f}" if scale != 1 else f"{q[name]:,.0f}" for name in QUANTILE_NAMES]
        table.add_row(label, *cells, str(q["n"]))
    console.print(table)
    console.print(
        f"step kinds: {kinds['pure_prefill']} pure prefill, {kinds['pure_decode']} pure decode, {kinds['mixed']} mixed"
    )
    if "envelope_reached" in summary:
        reached = ", ".join(f"{k} = {v:.2f}" for k, v in summary["envelope_reached"].items())
        console.print(f"envelope reached (max over steps): {reached}")


def floor_text(floor: dict) -> str:
    """"p50 x% [lo, hi], ..." of a `replicate_noise_floor` result: each figure with its interval where it has one."""
    parts = []
    for q in ("p50", "p90", "p99"):
        interval = (floor.get("interval") or {}).get(q)
        bounds = f" [{100 * interval[0]:.1f}%, {100 * interval[1]:.1f}%]" if interval else ""
        parts.append(f"{q} {100 * floor[q]:.1f}%{bounds}")
    return ", ".join(parts)


def print_noise_floor(console, floor: dict | None) -> None:
    if floor is None:
        console.print("noise floor: no repeated step compositions (use --repeat 2 or more)")
        return
    console.print(
        f"noise floor (one measurement's relative error, {floor['n_groups']} groups of identical steps, {floor['n_steps']} steps): "
        + floor_text(floor)
    )
